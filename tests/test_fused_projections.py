"""Fused projections (q/k/v and gate/up as one product each): same outputs, weights held once."""

from __future__ import annotations

import copy

import pytest
import torch

from ragsnap.runtime.loading.cpu_linears import can_pack, pack_linears, unpack_linears
from ragsnap.runtime.loading.fused_projections import ProjectionShare, fuse_projections
from tests.tiny_models import ARCHITECTURES, random_prompt, tiny_model


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fusing_keeps_a_models_logits_and_holds_each_weight_once(arch) -> None:
    model = tiny_model(arch).eval()
    fused = copy.deepcopy(model)
    layers = len(model.model.layers)
    assert fuse_projections(fused) == 2 * layers
    assert _parameters(fused) == _parameters(model)
    attention, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(attention.q_proj, ProjectionShare) and isinstance(
        mlp.up_proj, ProjectionShare
    )
    original = model.model.layers[0].self_attn
    rows = original.q_proj.out_features + original.k_proj.out_features * 2
    assert attention.qkv_proj.weight.shape == (rows, original.q_proj.in_features)
    ids = torch.tensor([random_prompt(40)])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert fuse_projections(fused) == 0  # a second call finds nothing left to fuse


def test_qwen2s_biases_are_fused_with_their_weights() -> None:
    model = tiny_model("qwen2").eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    x = torch.randn(3, model.config.hidden_size)
    for name in ("q_proj", "k_proj", "v_proj"):
        want = getattr(model.model.layers[1].self_attn, name)(x)
        got = getattr(fused.model.layers[1].self_attn, name)(x)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_the_shares_of_one_input_compute_one_product_and_keep_nothing_after() -> None:
    model = tiny_model("llama").eval()
    fuse_projections(model)
    attention = model.model.layers[0].self_attn
    calls: list[torch.Size] = []
    attention.qkv_proj.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    group = attention.q_proj.group
    x, y = torch.randn(2, 5, model.config.hidden_size).unbind()
    with torch.no_grad():
        q, k = attention.q_proj(x), attention.k_proj(x)
        assert group.last is not None and group.last.x is x  # v_proj has yet to take its part
        v = attention.v_proj(x)
        assert len(calls) == 1 and group.last is None
        assert q.shape[-1] == attention.q_proj.out_features and v.shape == k.shape
        # another input, or a share asking twice, gets a product of its own
        qy = attention.q_proj(y)
        q_again = attention.q_proj(y)
        assert len(calls) == 3
        torch.testing.assert_close(q_again, qy)
        assert not torch.equal(qy, q)


@pytest.mark.skipif(not can_pack(), reason="oneDNN cannot pack bfloat16 linears here")
def test_packing_and_unpacking_swap_the_fused_linear_its_shares_use() -> None:
    model = tiny_model("llama").to(torch.bfloat16).eval()
    fuse_projections(model)
    ids = torch.tensor([random_prompt(30)])
    with torch.no_grad():
        dense = model(ids).logits.float()
        pack_linears(model)
        assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "PackedLinear"
        packed = model(ids).logits.float()
        unpack_linears(model)
        again = model(ids).logits.float()
    torch.testing.assert_close(packed, dense, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(again, dense, atol=0, rtol=0)
