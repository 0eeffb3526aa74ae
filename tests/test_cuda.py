"""The engine on a CUDA device (issue 55): half precision against CPU float32, the sdpa and
flash-attn attention paths, batched decode, and KV memory as the device's allocator sees it.

Every test here skips without a CUDA device; ``bash scripts/gpu_check.sh`` installs what they
need on a CUDA machine and runs them (``-m cuda``). They use the embedded model.

Tolerances, stated once: the next-token distribution after a full prefill on CUDA is within
``KL_NATS[dtype]`` of CPU float32's (KL(cpu || cuda), nats) and picks the same token; the
first layer's values are within 4 unit roundoffs of the dtype in relative norm (one linear,
float32 accumulation) and its keys within 32 (RoPE is applied in the dtype: on CPU bfloat16
against float32 the keys of a 575-token prompt were off by 21 unit roundoffs, the values by
0.8, the next-token KL 0.0005 nats); a compressed cache keeps at least ``KEPT_OVERLAP`` of
the positions CPU float32 keeps (near-ties in the attention scores may fall the other way).
"""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from ragsnap.compression import make_press
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.model,
    pytest.mark.skipif(not CUDA, reason="no CUDA device (scripts/gpu_check.sh runs these on one)"),
]
HALF = ["float16", "bfloat16"]
KL_NATS = {"float16": 0.01, "bfloat16": 0.05, "float32": 1e-4}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
KEPT_OVERLAP = 0.8
FLASH = importlib.util.find_spec("flash_attn") is not None
ATTENTION = [
    "sdpa",
    pytest.param(
        "flash_attention_2",
        marks=pytest.mark.skipif(not FLASH, reason="flash-attn is not installed (the gpu extra)"),
    ),
]
TEXT = (
    "The Rosetta Stone is kept in the British Museum in London, where it has been on "
    "display since 1802. It was found in 1799 near the town of Rashid. "
)
_ENGINES: dict[tuple[str, str, str], object] = {}


def load(device: str, dtype: str, attention: str = "sdpa"):
    """The embedded engine on ``device`` in ``dtype`` (one per combination, kept)."""
    from ragsnap.engine.engine import RagSnapEngine

    key = (device, dtype, attention)
    if key not in _ENGINES:
        _ENGINES[key] = RagSnapEngine.load(
            "embedded",
            device=device,
            dtype=dtype,
            cache_url="none",
            speculate=0,
            speculate_ngrams=False,
            commit_lookahead=False,
            attn_implementation=attention,
            matmul_precision="highest",  # CPU float32 as the reference: no bfloat16 products
        )
    return _ENGINES[key]


def prompt(engine, question: str = "Where is the Rosetta Stone kept?", repeat: int = 6):
    docs = [Document(id=f"d{j}", title=f"Part {j}", text=TEXT * repeat) for j in range(2)]
    return engine.build_prompt(question, docs, GenerationConfig()).input_ids


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_prefill_on_cuda_matches_cpu_float32(dtype, attention) -> None:
    cpu, cuda = load("cpu", "float32"), load("cuda", dtype, attention)
    assert cuda.runtime.model.config._attn_implementation.endswith(
        attention
    )  # runtime hooks wrap it
    ids = prompt(cpu)
    assert prompt(cuda) == ids
    want = cpu.runtime.prefill(ids, make_press("full"))
    got = cuda.runtime.prefill(ids, make_press("full"))
    assert got.next_logits.device.type == "cuda"
    p = torch.log_softmax(want.next_logits.float().cpu(), -1)
    q = torch.log_softmax(got.next_logits.float().cpu(), -1)
    kl = float((p.exp() * (p - q)).sum())
    assert kl <= KL_NATS[dtype], f"KL(cpu || cuda {dtype}) = {kl:.4g} nats"
    assert int(p.argmax()) == int(q.argmax())
    (k_want, v_want), (k_got, v_got) = want.layers[0], got.layers[0]
    assert relative_error(k_got, k_want) <= 32 * UNIT_ROUNDOFF[dtype]
    assert relative_error(v_got, v_want) <= 4 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("dtype", HALF)
def test_compressed_cache_on_cuda_keeps_what_cpu_float32_keeps(dtype, attention) -> None:
    cpu, cuda = load("cpu", "float32"), load("cuda", dtype, attention)
    ids = prompt(cpu)
    press = {"budget": 64, "window": 16}
    want = cpu.runtime.prefill(ids, make_press("snapkv", **press))
    got = cuda.runtime.prefill(ids, make_press("snapkv", **press))
    assert got.kept_tokens_per_layer == want.kept_tokens_per_layer == [64] * len(want.kept)
    shared = total = 0
    for mine, theirs in zip(got.kept, want.kept, strict=True):
        for head_got, head_want in zip(mine.indices[0].cpu(), theirs.indices[0], strict=True):
            shared += len(set(head_got.tolist()) & set(head_want.tolist()))
            total += head_want.numel()
    assert shared / total >= KEPT_OVERLAP, f"kept overlap {shared / total:.3f}"
    # the answer decoded from the compressed cache starts as CPU float32's does
    answer_cpu = cpu.answer("Where is the Rosetta Stone kept?", _documents(), _options(cpu))
    answer_cuda = cuda.answer("Where is the Rosetta Stone kept?", _documents(), _options(cuda))
    assert answer_cuda.answer.split()[:3] == answer_cpu.answer.split()[:3]


def _documents() -> list[Document]:
    return [Document(id=f"d{j}", title=f"Part {j}", text=TEXT * 6) for j in range(2)]


def _options(engine):
    return engine.default_options(
        press=make_press("snapkv", budget=64, window=16),
        generation=GenerationConfig(max_new_tokens=12),
    )


def _decode(runtime, requests) -> list[list[int]]:
    batch = runtime.decode_batch(set())
    rows = [batch.add(i, prefill, generation) for i, (prefill, generation) in enumerate(requests)]
    for _ in batch.run():
        pass
    return [row.tokens for row in rows]


@pytest.mark.parametrize("dtype", ["float32", *HALF])
def test_batched_decode_on_cuda_matches_each_row_alone(dtype) -> None:
    """float32: token for token. Half precision: a batch's GEMMs may round differently from
    one row's, so a near-tie can flip late in an answer; every row starts the same and at
    least 3 of 4 rows are identical."""
    cuda = load("cuda", dtype)
    presses = [
        make_press("ragsnap", budget=64),
        make_press("snapkv", budget=96),
        make_press("pyramidkv", budget=80),
        make_press("full"),
    ]
    questions = ["Where is it kept?", "When was it found?", "Since when shown?", "Where found?"]
    requests = []
    for i, (question, press) in enumerate(zip(questions, presses, strict=True)):
        ids = prompt(cuda, question, repeat=2 + i)
        requests.append((cuda.runtime.prefill(ids, press), GenerationConfig(max_new_tokens=12)))
    alone = [_decode(cuda.runtime, [request])[0] for request in requests]
    together = _decode(cuda.runtime, requests)
    assert all(alone) and [t[:1] for t in together] == [a[:1] for a in alone]
    same = sum(t == a for t, a in zip(together, alone, strict=True))
    assert same == 4 if dtype == "float32" else same >= 3, (together, alone)


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("dtype", HALF)
def test_kv_memory_the_engine_reports_is_what_the_allocator_holds(dtype) -> None:
    cuda = load("cuda", dtype)
    runtime = cuda.runtime
    ids = prompt(cuda, repeat=8)
    per_token = runtime.kv_bytes_per_token()
    assert per_token == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, 2 bytes

    runtime.prefill(ids, make_press("full"))  # warm-up: the BLAS workspace, rotary tables
    before = _allocated()
    full = runtime.prefill(ids, make_press("full"))
    held_full = _allocated() - before
    assert full.kv_bytes_full == full.kv_bytes_kept == len(ids) * per_token
    # the cache is what stays allocated (the logits and the allocator's rounding beside it)
    slack = 2**20 + full.next_logits.numel() * 4
    assert full.kv_bytes_kept <= held_full <= full.kv_bytes_kept + slack
    del full
    assert _allocated() - before <= 2**20  # nothing of the prefill stays behind

    compressed = runtime.prefill(ids, make_press("snapkv", budget=64, window=16))
    held_compressed = _allocated() - before
    assert compressed.kv_bytes_full == len(ids) * per_token
    assert compressed.kv_bytes_kept == 64 * per_token
    # the full cache it was compressed from is freed: only the kept entries (and their
    # indices) stay
    assert compressed.kv_bytes_kept <= held_compressed <= compressed.kv_bytes_kept + slack

    batch = runtime.decode_batch(set())
    rows_before = _allocated()
    batch.add(0, compressed, GenerationConfig(max_new_tokens=4))
    batch.add(
        1,
        runtime.prefill(prompt(cuda, repeat=4), make_press("full")),
        GenerationConfig(max_new_tokens=4),
    )
    held_batch = _allocated() - rows_before
    assert batch.kv_bytes() <= batch.buffer_bytes()
    # the rows' buffers live on the device (a row may reuse its prefill's kept entries)
    assert held_batch >= batch.buffer_bytes() - compressed.kv_bytes_kept
