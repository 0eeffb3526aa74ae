"""4-bit weights for few-row products, where a model's weights lie on a 4-bit grid."""

from __future__ import annotations

import copy

import pytest
import torch

from ragsnap.runtime.loading.cpu_linears import can_pack, pack_linears
from ragsnap.runtime.loading.four_bit_linears import (
    GROUP,
    MAX_ROWS,
    FourBitLinear,
    four_bit_linears,
    on_grid,
)
from ragsnap.runtime.loading.fused_projections import fuse_projections
from tests.tiny_models import random_prompt, tiny_model


def _snapped(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` quantized as a GGUF Q4_1 block does (scale and minimum per
    group of 32 inputs), widened to bfloat16 as loading a GGUF does."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / 15).half().float()
    levels = torch.round((groups - low) / step).clamp(0, 15)
    return (levels * step + low.half().float()).view_as(weight).bfloat16()


def _four_bit_model() -> torch.nn.Module:
    model = tiny_model("llama").eval().to(torch.bfloat16)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(_snapped(module.weight))
    return model


def test_a_4_bit_weight_is_read_back_on_its_grid_and_another_is_refused() -> None:
    torch.manual_seed(0)
    weight = _snapped(torch.randn(48, 4 * GROUP))
    levels, scales_zeros = on_grid(weight)
    assert levels.min() >= 0 and levels.max() == 15 and scales_zeros.shape == (4, 48, 2)
    scale, zero = scales_zeros.float().permute(1, 0, 2).unbind(-1)  # [out, groups] each
    read = (levels.float().view(48, 4, GROUP) - 8) * scale[..., None] + zero[..., None]
    step = scale[..., None]  # a group's step
    assert bool(((read - weight.float().view(48, 4, GROUP)).abs() <= 0.1 * step).all())
    assert on_grid(torch.randn(48, 4 * GROUP).bfloat16()) is None  # not a 4-bit weight
    assert on_grid(_snapped(torch.randn(48, 4 * GROUP))[:, :40]) is None  # no whole groups


@pytest.mark.parametrize("rows", [1, MAX_ROWS, MAX_ROWS + 1, 64])
def test_few_rows_read_the_4_bit_copy_and_more_the_layer_itself(rows) -> None:
    torch.manual_seed(1)
    dense = torch.nn.Linear(2 * GROUP, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(_snapped(dense.weight))
    layer = FourBitLinear(dense, *on_grid(dense.weight))
    dense_calls: list[int] = []
    dense.register_forward_hook(lambda *_: dense_calls.append(1))
    x = torch.randn(1, rows, 2 * GROUP).bfloat16()
    with torch.no_grad():
        got = layer(x)
        calls = len(dense_calls)
        want = dense(x)
    assert got.shape == want.shape == (1, rows, 48)
    if rows > MAX_ROWS:
        assert calls == 1 and torch.equal(got, want)  # the layer's own product
    else:  # the 4-bit copy, not the layer: the same weights, bfloat16 rounding apart
        assert calls == 0
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


def test_a_4_bit_model_decodes_on_its_4_bit_weights_and_a_dense_one_stays_as_it_is() -> None:
    model = _four_bit_model()
    dense_copy = copy.deepcopy(model)  # the same bfloat16 weights, dense
    exact = copy.deepcopy(model).float()  # the 4-bit model itself, in float32
    fuse_projections(model)
    assert four_bit_linears(model) == 4 * len(model.model.layers)  # qkv, o, gate_up, down
    if can_pack():
        pack_linears(model)  # the dense layer inside is packed as any other
    ids = torch.tensor([random_prompt(24)])
    token = torch.tensor([[5]])

    def prompt_then_step(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            prompt = m(ids, use_cache=True)  # 24 rows: the dense weights
            step = m(token, cache=prompt.past_key_values)  # 1 row: the 4-bit ones
        return prompt.logits.float(), step.logits.float()

    prompt, step = prompt_then_step(model)
    dense_prompt, dense_step = prompt_then_step(dense_copy)
    exact_prompt, exact_step = prompt_then_step(exact)
    # the prompt (dense weights) and the step (4-bit ones) are as close to the model as
    # its bfloat16 copy is
    for got, dense, exact_logits in (
        (prompt, dense_prompt, exact_prompt),
        (step, dense_step, exact_step),
    ):
        error = (got - exact_logits).abs().max()
        assert error <= 2 * (dense - exact_logits).abs().max() + 0.05
    assert step[0, -1].argmax() == exact_step[0, -1].argmax()

    dense = tiny_model("llama").eval().to(torch.bfloat16)  # random weights: not 4-bit
    assert four_bit_linears(dense) == 0
    assert not any(isinstance(m, FourBitLinear) for m in dense.modules())
    assert four_bit_linears(tiny_model("llama").eval()) == 0  # float32: left as it is


@pytest.mark.model
def test_the_embedded_model_in_bfloat16_decodes_on_4_bit_weights_unless_turned_off() -> None:
    from ragsnap.runtime.decode import DRAFT_PASS_TOKENS
    from ragsnap.runtime.loading.models import load_model
    from ragsnap.runtime.model_runtime import ModelRuntime

    loaded = load_model("embedded", device="cpu", dtype="bfloat16")
    layers = loaded.model.model.layers
    assert loaded.four_bit and isinstance(layers[0].mlp.down_proj, FourBitLinear)
    assert sum(isinstance(m, FourBitLinear) for m in loaded.model.modules()) == 4 * len(layers)
    dense = load_model("embedded", device="cpu", dtype="bfloat16", four_bit_weights=False)
    assert not dense.four_bit
    assert not any(isinstance(m, FourBitLinear) for m in dense.model.modules())
    # a speculative pass stays within what the 4-bit products take
    assert ModelRuntime(loaded, speculate=8).decode_batch().pass_tokens == MAX_ROWS
    assert ModelRuntime(dense, speculate=8).decode_batch().pass_tokens == DRAFT_PASS_TOKENS


def test_entries_made_on_4_bit_weights_are_not_served_to_dense_weights(tmp_path) -> None:
    """Two processes on one store, one decoding on 4-bit weights: neither reads the other's
    entries (other weights, other KV), while a process like the writer does."""
    import dataclasses

    from ragsnap.cache import open_store
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.prompt.documents import Document
    from ragsnap.runtime.generation import GenerationConfig
    from tests.tiny_models import tiny_engine

    docs = [Document(id="a", title="t2", text=" ".join(f"t{i % 50}" for i in range(80)))]
    opts = AnswerOptions(generation=GenerationConfig(max_new_tokens=2), document_order="given")
    loaded = tiny_engine("llama").loaded

    def cache_status(four_bit: bool) -> str:
        engine = RagSnapEngine(
            dataclasses.replace(loaded, four_bit=four_bit),
            store=open_store(f"file://{tmp_path}"),
        )
        return list(engine.stream("t7 t8", docs, opts, namespace="ns"))[-1].stats.cache

    assert cache_status(four_bit=True) == "miss"
    assert cache_status(four_bit=False) == "miss"  # the 4-bit entry is not its KV
    assert cache_status(four_bit=False) == "hit"
    assert cache_status(four_bit=True) == "hit"
