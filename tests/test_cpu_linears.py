"""CPU weight layouts: packed linears (oneDNN bfloat16, fbgemm half-precision weights for
float32) compute what the dense ones do."""

from __future__ import annotations

import copy

import pytest
import torch

from ragsnap.runtime.loading.cpu_linears import (
    HalfWeightLinear,
    PackedLinear,
    can_pack,
    can_pack_half,
    column_major_linears,
    pack_linears,
    unpack_linears,
)
from tests.tiny_models import random_prompt, tiny_model

packing = pytest.mark.skipif(
    not can_pack(), reason="no oneDNN bfloat16 packing on this torch build or CPU"
)
half_packing = pytest.mark.skipif(not can_pack_half(), reason="no fbgemm in this torch build")


@packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64), (129, 64)])
def test_packed_linear_equals_the_dense_one(bias, shape):
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    want = dense(x)
    got = PackedLinear(dense)(x)
    assert got.shape == want.shape == (*shape[:-1], 48)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@packing
def test_a_packed_row_does_not_depend_on_the_rows_beside_it():
    torch.manual_seed(1)
    layer = PackedLinear(torch.nn.Linear(64, 96, dtype=torch.bfloat16))
    rows = torch.randn(8, 64, dtype=torch.bfloat16)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(8)])
    torch.testing.assert_close(layer(rows), alone, rtol=0, atol=0)


@packing
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_packed_model_keeps_its_logits_and_its_tied_embedding(arch):
    model = tiny_model(arch, tie_word_embeddings=True).to(torch.bfloat16).eval()
    packed = copy.deepcopy(model)
    embedding = packed.get_input_embeddings().weight
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_linears(packed) == linears
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert packed.get_input_embeddings().weight is embedding  # the embedding stays dense
    ids = torch.tensor([random_prompt(24)])
    with torch.no_grad():
        want = model(ids).logits.float()
        got = packed(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))


@half_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (8, 64), (2, 3, 64), (129, 64), (0, 64)])
def test_a_half_weight_linear_computes_with_the_rounded_weight_in_float32(bias, shape):
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48, bias=bias)
    x = torch.randn(*shape)
    layer = HalfWeightLinear(dense)
    rounded = dense.weight.detach().half().float()
    assert torch.equal(layer.dense_weight(), rounded)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 48)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, rounded, dense.bias))
    # only the weight is rounded: far closer to the float32 layer than a bfloat16 one is
    full = dense(x)
    if x.numel():
        assert (got - full).abs().max() < 1e-2 * full.abs().max()


@half_packing
def test_a_half_weight_row_depends_on_the_rows_beside_it_only_to_float32_rounding():
    torch.manual_seed(1)
    layer = HalfWeightLinear(torch.nn.Linear(64, 96))
    rows = torch.randn(8, 64)
    rows[3] *= 1000  # a loud neighbour: activations are not quantized per batch
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(8)])
    together = layer(rows)
    quiet = [i for i in range(8) if i != 3]
    torch.testing.assert_close(together[quiet], alone[quiet], rtol=1e-5, atol=1e-5)
    assert (together[3] - alone[3]).abs().max() < 1e-5 * alone[3].abs().max()


@half_packing
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_float32_model_packs_its_weights_in_half_precision_and_keeps_its_greedy_tokens(arch):
    model = tiny_model(arch, tie_word_embeddings=True).eval()
    packed = copy.deepcopy(model)
    embedding = packed.get_input_embeddings().weight
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_linears(packed) == linears
    assert sum(isinstance(m, HalfWeightLinear) for m in packed.modules()) == linears
    assert packed.get_input_embeddings().weight is embedding  # the embedding stays float32
    assert embedding.dtype == torch.float32
    ids = torch.tensor([random_prompt(24)])
    with torch.no_grad():
        want = model(ids).logits
        got = packed(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))
    # unpacked, the model computes with the rounded weights, densely, to float32 accuracy
    assert unpack_linears(packed) == linears
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, got, rtol=1e-4, atol=1e-4)


def test_column_major_keeps_values():
    model = tiny_model("llama").eval()
    before = {n: p.clone() for n, p in model.named_parameters()}
    column_major_linears(model)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
    assert all(
        not m.weight.is_contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


@pytest.mark.parametrize(
    ("namespace", "op", "message", "probe", "dtype", "layer"),
    [
        (  # a torch build whose quantized engine lacks fbgemm
            "quantized",
            "linear_prepack_fp16",
            "Didn't find engine for operation quantized::linear_prepack_fp16",
            "can_pack_half",
            torch.float32,
            HalfWeightLinear,
        ),
        (  # what oneDNN says on an AVX2-only CPU
            "mkldnn",
            "_reorder_linear_weight",
            "bf16 path needs the cpu support avx512bw, avx512vl and avx512dq",
            "can_pack",
            torch.bfloat16,
            PackedLinear,
        ),
    ],
)
def test_a_build_or_cpu_that_refuses_to_pack_keeps_its_linears_dense(
    monkeypatch, namespace, op, message, probe, dtype, layer
):
    import ragsnap.runtime.loading.cpu_linears as cpu_linears

    real = getattr(torch.ops, namespace)

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

    def refuse(*args):
        raise RuntimeError(message)

    setattr(Refusing, op, staticmethod(refuse))
    monkeypatch.setattr(cpu_linears.torch.ops, namespace, Refusing())
    getattr(cpu_linears, probe).cache_clear()
    try:
        model = tiny_model("llama").to(dtype).eval()
        assert not getattr(cpu_linears, probe)()
        assert pack_linears(model) == 0
        assert not any(isinstance(m, layer) for m in model.modules())
    finally:
        monkeypatch.undo()
        getattr(cpu_linears, probe).cache_clear()
