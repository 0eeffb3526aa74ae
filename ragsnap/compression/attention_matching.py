"""Query-aware Attention Matching: refit what a press kept so attention behaves as with the full cache.

After Zweiger et al. (arXiv 2602.16284), made query-aware: the reference queries are the
observation window's queries (the question), per KV head all the queries of its group.
Two fits per layer and KV head, batched over heads:

1. mass: dropping keys shrinks the softmax denominator, so each kept prefix key gets a
   bias ``beta = log w`` with ``w >= 0`` fitted (non-negative least squares) so that
   ``sum_j w_j exp(q.c_j s) ~= sum_i exp(q.k_i s)`` over all prefix keys, per query;
2. output: the kept prefix values are refit by ridge regression so that the compressed
   attention output matches the full one, pulled toward their original values (there are
   fewer reference queries than kept keys, so the prior decides the rest).

The window's keys and values stay exact; entries a selector marked ``exact`` get neither a
bias nor a refit.
Decoding adds ``beta`` to the kept keys' logits through the runtime's per-layer additive mask
(``ragsnap.runtime.attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.compression.base import CompressedLayer, LayerContext, Press, WrapperPress
from ragsnap.compression.snapkv import SnapKVPress, window_attention
from ragsnap.errors import ConfigError

# Ridge strength relative to the reference queries' attention energy (see refit_values),
# chosen on 6 HotpotQA + 6 BioASQ factoid items (KL at budgets 128-512, 0.003-1.0; README).
DEFAULT_RIDGE = 0.03
DEFAULT_MASS_ITERATIONS = 30


def fit_mass_weights(kept: torch.Tensor, target: torch.Tensor, iterations: int) -> torch.Tensor:
    """Non-negative ``w`` with ``kept @ w ~= target``, by multiplicative updates from ``w = 1``.

    Parameters
    ----------
    kept : ``[..., Q, n]`` non-negative ``exp(logit - rowmax)`` of the kept keys.
    target : ``[..., Q]`` the same sum over all keys.

    Returns
    -------
    ``[..., n]`` weights; the updates keep them non-negative, and starting from 1 keeps
    the under-determined problem (``Q < n``) close to "no bias".
    """
    # as row vectors ([N, 1, Q] and [N, 1, n]) every product is one bmm GEMV, and an
    # iteration is five operations (a compression is mostly such small operations: their
    # count, not their arithmetic, sets its time)
    shape = kept.shape
    count = math.prod(shape[:-2])
    flat = kept.reshape(count, shape[-2], shape[-1])  # A: [N, Q, n] (n may be 0)
    flat_t = flat.transpose(1, 2).contiguous()  # A^T: [N, n, Q]
    numerator = torch.bmm(target.reshape(count, 1, shape[-2]).to(kept.dtype), flat)  # (A^T b)^T
    weights = torch.ones_like(numerator)
    for _ in range(iterations):
        denominator = torch.bmm(torch.bmm(weights, flat_t), flat)  # (A^T A w)^T: [N, 1, n]
        weights.mul_(numerator).div_(denominator.clamp_min_(1e-30))
    return weights.view(shape[:-2] + (shape[-1],))


def refit_values(
    weights: torch.Tensor, values: torch.Tensor, residual: torch.Tensor, ridge: float
) -> torch.Tensor:
    """Ridge update ``delta`` minimizing ``|weights @ delta - residual|^2 + lam |delta|^2``.

    Solved in query space (push-through identity): ``delta = W^T (W W^T + lam I)^-1 R``, a
    ``Q x Q`` system rather than ``n x n``. ``lam = ridge * mean(diag(W W^T))`` scales with
    the attention weights.

    Parameters
    ----------
    weights : ``[..., Q, n]`` compressed attention of the reference queries on the refit keys.
    values : ``[..., n, D]`` current values of those keys.
    residual : ``[..., Q, D]`` full-cache output minus the compressed output.

    Returns
    -------
    ``[..., n, D]`` refit values.
    """
    gram = weights @ weights.transpose(-1, -2)  # [..., Q, Q]
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).clamp_min(1e-12)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    system = gram + (ridge * scale).unsqueeze(-1) * eye
    # the system is symmetric positive definite (lam > 0): Cholesky. torch 2.13's CPU LU
    # (linalg.solve) intermittently fails with "pivots ... >= 1" on systems over ~128 rows.
    delta = weights.transpose(-1, -2) @ torch.cholesky_solve(
        residual, torch.linalg.cholesky(system)
    )
    return values + delta


@dataclass
class AttentionMatchingPress(WrapperPress):
    """Wrap a press: keep what it keeps, then fit a logit bias and refit the kept values."""

    name = "attnmatch"
    base: Press = field(default_factory=SnapKVPress)
    ridge: float = DEFAULT_RIDGE
    mass_iterations: int = DEFAULT_MASS_ITERATIONS

    def __post_init__(self) -> None:
        if self.ridge <= 0:
            raise ConfigError(f"ridge must be positive, got {self.ridge}", field="ridge")
        if self.mass_iterations < 0:
            raise ConfigError("mass_iterations must be >= 0", field="mass_iterations")

    def config(self) -> dict[str, Any]:
        return {
            **self.base.config(),
            "press": self.name,
            "ridge": self.ridge,
            "mass_iterations": self.mass_iterations,
        }

    def compress(self, layer: LayerContext) -> CompressedLayer:
        kept = self.base.compress(layer)
        seq_len, n_kept = layer.seq_len, kept.indices.shape[-1]
        window = min(self.window, seq_len)
        if n_kept >= seq_len or not window or layer.hidden_states.shape[1] < window:
            return kept  # nothing dropped (or no window to refer to): already exact
        prefix, n_prefix = seq_len - window, n_kept - window
        batch, heads = layer.keys.shape[:2]
        # full attention of the reference queries, [B, Hkv, Q, L] with Q = G * w (shared with SnapKV)
        full = window_attention(layer, window).flatten(2, 3)
        target_out = full @ layer.values.float()  # [B, Hkv, Q, D]

        # In probability space: p_i = exp(l_i - m_q) / Z_q, so fitting sum_j w_j p_j ~= sum_i p_i
        # over the prefix is the mass fit of exp-logits, each query's row scaled by 1/Z_q.
        kept_prefix = kept.indices[..., :n_prefix]  # window positions are the last ones kept
        kept_probs = full[..., :prefix].gather(
            -1, kept_prefix.unsqueeze(2).expand(-1, -1, full.shape[2], -1)
        )  # [B, Hkv, Q, n_prefix]
        # entries marked exact (kept only to complete a word: the window barely attends to
        # them, so a fitted bias or value would be noise) keep w = 1 and their values
        free = torch.ones_like(kept_prefix, dtype=torch.bool)
        if kept.exact is not None:
            free = ~kept.exact[..., :n_prefix]
        fixed_mass = (kept_probs * ~free.unsqueeze(2)).sum(-1)  # [B, Hkv, Q]
        target_mass = (full[..., :prefix].sum(-1) - fixed_mass).clamp_min(0)
        mass = fit_mass_weights(kept_probs * free.unsqueeze(2), target_mass, self.mass_iterations)
        mass = torch.where(free, mass, torch.ones_like(mass)).clamp_min(1e-6)
        beta = mass.log()  # [B, Hkv, n_prefix]

        # compressed attention with the bias: kept prefix p_j w_j and the exact window, renormalized
        unnormalized = torch.cat([kept_probs * mass.unsqueeze(2), full[..., prefix:]], -1)
        compressed = unnormalized / unnormalized.sum(-1, keepdim=True).clamp_min(1e-30)
        values = kept.values.float()
        weights = compressed[..., :n_prefix] * free.unsqueeze(2)  # refit only free entries
        residual = target_out - compressed @ values  # [B, Hkv, Q, D]
        refit = refit_values(weights, values[..., :n_prefix, :], residual, self.ridge)

        new_values = values.clone()
        new_values[..., :n_prefix, :] = torch.where(
            free.unsqueeze(-1), refit, values[..., :n_prefix, :]
        )
        bias = torch.zeros(batch, heads, n_kept, dtype=torch.float32, device=kept.keys.device)
        bias[..., :n_prefix] = beta
        return CompressedLayer(
            indices=kept.indices,
            keys=kept.keys,
            values=new_values.to(kept.values.dtype),
            bias=bias,
            exact=kept.exact,
        )
