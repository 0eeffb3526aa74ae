"""CPU weight layouts: oneDNN-packed bfloat16 linears compute what the dense ones do."""

from __future__ import annotations

import copy

import pytest
import torch

from ragsnap.cpu_linears import PackedLinear, can_pack, column_major_linears, pack_linears
from tests.tiny_models import random_prompt, tiny_model

packing = pytest.mark.skipif(
    not can_pack(), reason="no oneDNN bfloat16 packing on this torch build or CPU"
)


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


def test_float32_models_are_not_packed_and_column_major_keeps_values():
    model = tiny_model("llama").eval()
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert pack_linears(model) == 0
    column_major_linears(model)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
    assert all(
        not m.weight.is_contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


def test_a_cpu_that_refuses_the_bfloat16_reorder_keeps_its_linears_dense(monkeypatch):
    real = torch.ops.mkldnn

    class Refusing:  # what oneDNN says on an AVX2-only CPU
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def _reorder_linear_weight(weight, batch):
            raise RuntimeError("bf16 path needs the cpu support avx512bw, avx512vl and avx512dq")

    import ragsnap.cpu_linears as cpu_linears

    monkeypatch.setattr(cpu_linears.torch.ops, "mkldnn", Refusing())
    cpu_linears.can_pack.cache_clear()
    try:
        model = tiny_model("llama").to(torch.bfloat16).eval()
        assert not cpu_linears.can_pack()
        assert pack_linears(model) == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    finally:
        monkeypatch.undo()
        cpu_linears.can_pack.cache_clear()
