"""Projections of one input computed as one product: ``qkv_proj`` and ``gate_up_proj``.

Each decoder layer multiplies one input by ``q_proj``, ``k_proj`` and ``v_proj``, and
another by ``gate_proj`` and ``up_proj``. A decode step multiplies a handful of rows, so a
product costs its call and the streaming of a short weight more than arithmetic: on the
embedded model (4 rows, bfloat16, oneDNN-packed, 2 threads) the five products of 30 layers
take 12.8 ms a step, two products of the concatenated weights 9.2 ms.

:func:`fuse_projections` concatenates each group's weights into one ``nn.Linear``
registered beside them (``self_attn.qkv_proj``, ``mlp.gate_up_proj``; packed afterwards
like any other linear) and puts a :class:`ProjectionShare` in each original's place, so
the weights are held once. A share returns its columns of the fused product of its input.
Shares called with the same input tensor one after another (transformers' module tree does
exactly that) compute the product once: it is kept until every share has taken its
columns, keyed on the input's identity (inference tensors carry no version counter, so an
input changed in place between the calls would not be noticed; no module does that).
:class:`~ragsnap.runtime.llama_pass.LlamaPass` calls the fused linear directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# (module attribute holding the group, the fused linear's name, the projections it fuses)
GROUPS = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
)


class _Product:
    """The last fused product: its input, output ``[..., sum of out_features]`` and the
    shares that have taken their columns from it."""

    __slots__ = ("x", "out", "taken")

    def __init__(self, x: torch.Tensor, out: torch.Tensor, taken: frozenset[int]) -> None:
        self.x, self.out, self.taken = x, out, taken


class ProjectionShare(torch.nn.Module):
    """Columns ``start:end`` of a fused projection, in place of the linear that held them.

    ``forward``: ``x`` ``[..., in_features]`` -> ``[..., end - start]`` (a view of the
    fused product). The fused linear is registered once, on the shares' owner; ``group``
    (shared by the group's shares) finds it there.
    """

    def __init__(self, group: FusedGroup, index: int, start: int, end: int) -> None:
        super().__init__()
        self.group = group
        self.index, self.start, self.end = index, start, end
        self.in_features = group.linear.in_features
        self.out_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self.group.last  # one read: another thread may replace it meanwhile
        if product is None or product.x is not x or self.index in product.taken:
            product = _Product(x, self.group.linear(x), frozenset())
        taken = product.taken | {self.index}
        self.group.last = (
            None if len(taken) == self.group.shares else _Product(x, product.out, taken)
        )
        return product.out[..., self.start : self.end]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.end} of a fused projection"


class FusedGroup:
    """What one group's shares have in common (not a module): the fused linear, looked up
    on its owner at each call (packing or unpacking replaces it there), and the last
    product."""

    def __init__(self, owner: torch.nn.Module, name: str, shares: int) -> None:
        self.owner, self.name, self.shares = owner, name, shares
        self.last: _Product | None = None

    @property
    def linear(self) -> torch.nn.Module:
        return getattr(self.owner, self.name)


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse every layer's ``q/k/v_proj`` and ``gate/up_proj`` of ``model``, in place
    (values unchanged: the fused weight is the originals' rows stacked). Groups whose
    members are not plain ``nn.Linear`` layers of one input size, dtype and bias setting
    are left as they are. Returns how many groups were fused."""
    fused = 0
    for module in list(model.modules()):
        for attribute, name, members in GROUPS:
            owner = getattr(module, attribute, None)
            if not isinstance(owner, torch.nn.Module) or hasattr(owner, name):
                continue
            linears = [getattr(owner, member, None) for member in members]
            if _fusable(linears):
                _fuse(owner, name, members, linears)
                fused += 1
    return fused


def fused_linear(owner: Any, name: str) -> torch.nn.Module | None:
    """``owner``'s fused linear ``name`` (``qkv_proj``, ``gate_up_proj``), or None."""
    linear = getattr(owner, name, None)
    return linear if isinstance(linear, torch.nn.Module) else None


def _fusable(linears: Sequence[Any]) -> bool:
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return False
    first = linears[0]
    return all(
        linear.in_features == first.in_features
        and linear.weight.dtype == first.weight.dtype
        and linear.weight.device == first.weight.device
        and (linear.bias is None) == (first.bias is None)
        for linear in linears
    )


def _fuse(
    owner: torch.nn.Module, name: str, members: Sequence[str], linears: Sequence[Any]
) -> None:
    first = linears[0]
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None if first.bias is None else torch.cat([lin.bias.detach() for lin in linears])
    linear = torch.nn.Linear(
        first.in_features, weight.shape[0], bias=bias is not None, device="meta"
    )
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    owner.add_module(name, linear)
    group = FusedGroup(owner, name, len(linears))
    start = 0
    for index, (member, original) in enumerate(zip(members, linears, strict=True)):
        end = start + original.out_features
        setattr(owner, member, ProjectionShare(group, index, start, end))
        start = end
