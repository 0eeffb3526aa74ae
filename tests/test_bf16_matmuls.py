"""``medium`` matmul precision: float32 models whose documents' passes run bfloat16 products."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from ragsnap.cli import build_parser
from ragsnap.engine.options import config_from_args
from ragsnap.errors import ModelLoadError
from ragsnap.runtime.attention import install_runtime_attention
from ragsnap.runtime.loading import models
from ragsnap.runtime.loading.bf16_matmuls import bf16_matmuls as bf16_scope
from ragsnap.runtime.loading.bf16_matmuls import (
    mark_attention,
    medium_allowed,
    medium_products,
)
from ragsnap.runtime.loading.cpu_linears import (
    HalfWeightLinear,
    can_pack,
    can_pack_half,
    pack_linears,
)
from ragsnap.runtime.loading.models import resolve_matmul_precision
from tests.tiny_models import random_prompt, tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_bf16 = pytest.mark.skipif(
    not (can_pack() and can_pack_half()), reason="no oneDNN bfloat16 or fbgemm on this CPU"
)


def precision() -> str:
    return torch.backends.mkldnn.matmul.fp32_precision


def test_medium_is_for_float32_cpu_models_and_auto_follows_the_cpu(monkeypatch):
    import ragsnap.runtime.loading.cpu_linears as cpu_linears

    monkeypatch.setattr(cpu_linears, "can_pack", lambda: True)
    monkeypatch.setattr(cpu_linears, "can_pack_half", lambda: True)
    monkeypatch.setattr(models, "avx512_bf16", lambda: False)
    assert not resolve_matmul_precision("auto", CPU, torch.float32)
    assert resolve_matmul_precision("medium", CPU, torch.float32)  # asked for: honoured
    monkeypatch.setattr(models, "avx512_bf16", lambda: True)
    assert resolve_matmul_precision("auto", CPU, torch.float32)
    assert not resolve_matmul_precision("highest", CPU, torch.float32)
    assert not resolve_matmul_precision("medium", CPU, torch.bfloat16)  # already bfloat16
    assert not resolve_matmul_precision("medium", CUDA, torch.float32)


def test_medium_where_it_cannot_run_and_unknown_values_are_refused(monkeypatch):
    import ragsnap.runtime.loading.cpu_linears as cpu_linears

    with pytest.raises(ModelLoadError, match="'low'"):
        resolve_matmul_precision("low", CPU, torch.float32)
    monkeypatch.setattr(cpu_linears, "can_pack", lambda: False)
    monkeypatch.setattr(models, "avx512_bf16", lambda: True)
    assert not resolve_matmul_precision("auto", CPU, torch.float32)
    with pytest.raises(ModelLoadError, match="medium.*highest or auto"):
        resolve_matmul_precision("medium", CPU, torch.float32)


def test_every_model_command_takes_the_precision(monkeypatch):
    monkeypatch.setenv("RAGSNAP_MATMUL_PRECISION", "highest")
    for command in (["ask", "-q", "x", "--docs", "a.md"], ["bench", "peer", "--data", "d"]):
        args = build_parser().parse_args([*command, "--matmul-precision", "medium"])
        assert args.matmul_precision == "medium"
        assert config_from_args(build_parser().parse_args(command)).matmul_precision == "highest"
    assert (
        build_parser().parse_args(["serve", "--matmul-precision", "medium"]).matmul_precision
        == "medium"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["bench", "prefill", "--context", "64", "--matmul-precision", "x"]
        )


def test_the_scope_restores_the_setting_when_the_last_overlapping_block_leaves():
    before = precision()
    entered, leave_first = threading.Event(), threading.Event()

    def first() -> None:
        with bf16_scope():
            entered.set()
            leave_first.wait(5)

    worker = threading.Thread(target=first)
    worker.start()
    assert entered.wait(5)
    with bf16_scope():
        assert precision() == "bf16"
        leave_first.set()
        worker.join(5)
        assert precision() == "bf16"  # the first block left; this one still runs
        with bf16_scope():  # nested
            assert precision() == "bf16"
        assert precision() == "bf16"
    assert precision() == before


@needs_bf16
def test_document_passes_multiply_in_bfloat16_and_the_others_in_half_precision():
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 96)
    layer = HalfWeightLinear(dense, documents_bf16=True)
    half = HalfWeightLinear(dense)
    x = torch.randn(2, 24, 64)
    assert torch.equal(layer(x), half(x))
    with medium_products():
        got = layer(x)
        with medium_products(False):  # a nested exact block
            assert torch.equal(layer(x), half(x))
    assert got.dtype == torch.float32 and got.shape == (2, 24, 96)
    # bfloat16 inputs, float32 accumulation, the product rounded to bfloat16
    product = x.bfloat16().float() @ dense.weight.detach().bfloat16().float().T
    rounded = product.bfloat16().float() + dense.bias
    torch.testing.assert_close(got, rounded, rtol=8e-3, atol=1e-3)
    exact = dense(x).detach()
    assert (got - exact).abs().max() > (half(x) - exact).abs().max()


@needs_bf16
def test_packing_at_medium_leaves_the_lm_head_in_half_precision_only():
    model = tiny_model("llama").eval()
    pack_linears(model, documents_bf16=True)
    head = model.get_output_embeddings()
    layers = [m for m in model.modules() if isinstance(m, HalfWeightLinear) and m is not head]
    assert layers and all(m.packed_bf16 is not None for m in layers)
    assert isinstance(head, HalfWeightLinear) and head.packed_bf16 is None


BF16_UNIT = 2.0**-8  # unit roundoff of bfloat16: 8 significant bits
FP32_UNIT = 2.0**-24


def product_error(length: int) -> float:
    """Relative bound on one entry of a product with bfloat16 inputs and float32 sums.

    Rounding both inputs changes each term ``a_k b_k`` by at most ``(2u + u^2) |a_k b_k|``;
    a float32 sum of ``length`` terms adds ``length * u32`` of ``sum |a_k b_k|``; a result
    that is itself rounded to bfloat16 (some kernels do) adds ``u`` more. So
    ``|fl(a . b) - a . b| <= product_error(length) * (|a| . |b|)``.
    """
    return 3 * BF16_UNIT + BF16_UNIT**2 + length * FP32_UNIT


def attention_error_bound(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **_: object,
) -> torch.Tensor:
    """Elementwise bound on how far sdpa's output moves when both of its products take
    bfloat16 inputs (:func:`product_error`), derived through the softmax.

    Parameters
    ----------
    query : ``[B, Hq, q, D]``; key, value : ``[B, Hkv, kv, D]``; ``attn_mask`` broadcast to
    ``[B, Hq, q, kv]`` (bool: visible, float: additive).

    Returns
    -------
    ``[B, Hq, q, D]``. A score error of at most ``E_i`` per query row scales every
    probability by a factor in ``[exp(-2 E_i), exp(2 E_i)]``, so ``|dP| <= (exp(2 E_i) - 1) P``;
    the product with the values then adds ``product_error(kv) * (P' |V|)``.
    """
    q, k, v = query.double(), key.double(), value.double()
    if enable_gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = scale * q @ k.transpose(-1, -2)
    score_error = product_error(q.shape[-1]) * scale * (q.abs() @ k.abs().transpose(-1, -2))
    visible = torch.ones_like(scores, dtype=torch.bool)
    if is_causal:
        visible = visible.tril(k.shape[2] - q.shape[2])
    if attn_mask is not None:
        bias = attn_mask.double() if attn_mask.dtype != torch.bool else None
        visible = visible & (attn_mask if bias is None else bias > -1e30)
        scores = scores if bias is None else scores + bias.clamp(min=-1e30)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    worst = score_error.masked_fill(~visible, 0).amax(-1, keepdim=True)
    growth = torch.expm1(2 * worst)
    spread = probs @ v.abs()
    return growth * spread + product_error(k.shape[2]) * (1 + growth) * spread


def sdpa_rounds_in_bf16() -> bool:
    """Whether torch's CPU attention kernel honours the bfloat16 precision here: it does on
    CPUs with AMX; on an AVX-512 EPYC with AVX512-BF16 (torch 2.13) it computes exactly."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    exact = sdpa(q, k, v)
    with bf16_scope():
        return not torch.equal(sdpa(q, k, v), exact)


def test_marked_attention_runs_document_passes_with_bfloat16_products(monkeypatch):
    exact = tiny_model("llama").eval()
    marked = copy.deepcopy(exact)
    for model in (exact, marked):
        install_runtime_attention(model)
    mark_attention(marked)
    seen: list[str] = []
    calls: list[tuple[tuple, dict, torch.Tensor]] = []  # the bfloat16 calls, with outputs
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(precision())
        out = sdpa(*args, **kwargs)
        if seen[-1] == "bf16":
            calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    before = precision()
    ids = torch.tensor([random_prompt(64, seed=1)])
    with torch.no_grad():
        with medium_products():
            exact(ids)  # an unmarked model is unaffected
            assert seen and set(seen) == {before}
            seen.clear()
            marked(ids)
            assert seen and set(seen) == {"bf16"}
            seen.clear()
        assert precision() == before
        marked(ids)  # outside a document pass: exact
        assert seen and set(seen) == {before}
        # each bfloat16 call against the exact product of the same inputs, within the
        # bound that bfloat16's precision and the reduction lengths allow, and not exact
        # where the kernel rounds at all on this CPU
        assert len(calls) >= len(marked.model.layers)
        moved = 0.0
        for args, kwargs, got in calls:
            want = sdpa(*args, **kwargs)
            error = (got.double() - want.double()).abs()
            bound = attention_error_bound(*args, **kwargs)
            assert bool((error <= bound).all()), float((error / bound).max())
            moved = max(moved, float(error.max()))
        assert (moved > 0) == sdpa_rounds_in_bf16()


@needs_bf16
def test_a_whole_prompt_at_medium_is_computed_as_a_prefix_hit_computes_it():
    from ragsnap.compression import make_press
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.prompt.assembly import PromptLayout
    from ragsnap.prompt.documents import Document
    from ragsnap.runtime.loading.models import LoadedModel
    from ragsnap.runtime.prefill import tail_start
    from tests.tiny_models import tiny_tokenizer

    model = tiny_model("llama").eval()
    pack_linears(model, documents_bf16=True)
    mark_attention(model)
    loaded = LoadedModel(model, tiny_tokenizer(), "tiny", "random", CPU, matmul_precision="medium")
    runtime = RagSnapEngine(loaded).runtime
    ids = random_prompt(120, seed=2)
    doc = Document(id="d", title="notes", text="x")
    layout = PromptLayout(input_ids=ids, prefix_len=100, documents=[doc], doc_spans=[(0, 100)])
    press = make_press("snapkv", budget=48, window=8)
    passes: list[tuple[int, bool]] = []  # (positions, in a documents' pass) of layer 0
    projection = model.model.layers[0].self_attn.q_proj
    projection.register_forward_pre_hook(
        lambda _, args: passes.append((args[0].shape[1], medium_allowed()))
    )
    whole = runtime.prefill_prompt(layout, press)
    # the documents in bfloat16; the tail and the press's window queries exact
    assert passes[:2] == [(100, True), (20, False)]
    assert not any(documents for _, documents in passes[2:])
    start = tail_start(layout, press)
    documents = runtime.prefill_full(ids[: layout.prefix_len])
    cropped = runtime.cache_from([(k[:, :, :start], v[:, :, :start]) for k, v in documents])
    hit = runtime.prefill(ids, press, cache=cropped, start=start)
    assert torch.equal(whole.next_logits, hit.next_logits)
    for a, b in zip(whole.kept, hit.kept, strict=True):
        assert torch.equal(a.indices, b.indices)
    assert whole.processed_tokens == layout.prefix_len + len(ids) - start


def test_decode_steps_between_document_chunks_run_outside_the_documents_pass():
    from ragsnap.runtime.prefill import prefill_full
    from tests.tiny_models import tiny_engine

    runtime = tiny_engine("llama").runtime
    inside: list[bool] = []  # what the scheduler's decode steps would see
    cache = runtime.new_cache()
    prefill_full(
        runtime.model,
        runtime.cache_kwarg,
        random_prompt(50),
        cache,
        chunk=16,
        on_chunk=lambda: inside.append(medium_allowed()),
    )
    assert inside == [False, False, False]  # after chunks 1-3 of 4
    assert cache.get_seq_length() == 50
