"""The layer-split forward of query-aware prefill (token-selective propagation).

A prompt of ``L`` tokens runs through the lower layers ``0 .. s-1`` with the model's own
forward, in the usual chunks (a hook on decoder layer ``s - 1`` stops each pass there and
keeps its output). On the last chunk the observation window's queries at layer ``s - 1``
vote (:func:`token_votes`: SnapKV's pooled scores per KV head, then the best head per
position), and :func:`select_tokens` keeps ``n`` of the ``L`` positions: the forced ones
(the window, the instruction, the document headers) and the best voted. The upper layers
``s .. L-1`` then run over those ``n`` tokens only (:meth:`LayerSplit.upper`), calling the
decoder layers directly with the gathered hidden states, the ORIGINAL positions (their RoPE
angles) and a causal mask over the kept order (sliding layers bounded by original
positions); their cache receives the ``n`` tokens' entries only. Nothing is patched: the
hooks live inside :meth:`LayerSplit.installed` and act only while this split runs a pass.

Shapes: ``L`` prompt tokens, ``n`` propagated, ``H`` hidden size, ``Hkv`` KV heads, ``w``
the window, ``q`` tokens in one pass.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ragsnap.compression.base import LayerContext
from ragsnap.compression.hooks import attention_modules
from ragsnap.compression.snapkv import pool_scores, window_attention
from ragsnap.runtime.kv import sliding_windows


class _Stop(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the hook on layer ``s - 1`` to end a lower pass there."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("lower layers done")
        self.hidden = hidden


def token_votes(layer: LayerContext, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """Votes of the window's queries for the prefix positions of one layer.

    Parameters
    ----------
    layer : the layer at the end of the lower pass: ``keys`` ``[1, Hkv, L, D]``, the
        pass's ``hidden_states`` ``[1, q, H]`` (q >= w).
    window, kernel, pooling : the press's SnapKV parameters.

    Returns
    -------
    ``[L - w]`` float32: per position, minus its best rank over KV heads, each head
    ranking positions by its pooled SnapKV score (softmax rows summed over the window,
    averaged over the head's group). The top ``k`` are then the union of every head's
    top choices, a few more from each: no head's picks are crowded out by a head whose
    scores run larger (on 4 held-out HotpotQA items this held KL closer to the full path
    than the highest score over heads or the mean over heads did).
    """
    w = min(window, layer.seq_len)
    if w == layer.seq_len:  # the window is the whole prompt: no position before it to rank
        return torch.zeros(0, device=layer.keys.device)
    attention = window_attention(layer, w)[..., : layer.seq_len - w]  # [1, Hkv, G, w, L-w]
    votes = attention.sum(dim=-2).mean(dim=2)  # [1, Hkv, L - w]
    pooled = pool_scores(votes, kernel, pooling)[0]  # [Hkv, L - w]
    ranks = pooled.argsort(dim=-1, descending=True).argsort(dim=-1)  # 0 = the head's best
    return -ranks.amin(dim=0).float()


def select_tokens(
    votes: torch.Tensor, length: int, keep: int, forced: torch.Tensor
) -> torch.Tensor:
    """The positions that propagate, ascending.

    Parameters
    ----------
    votes : ``[L - w]`` scores of the prefix positions (the last ``w`` are the window).
    length : ``L``.
    keep : how many positions propagate in all (clamped to ``[forced, L]``).
    forced : ``[L]`` bool, positions that always propagate (the window is added here).

    Returns
    -------
    ``[n]`` long, sorted original positions.
    """
    prefix = votes.shape[0]
    must = forced.clone()
    must[prefix:] = True
    scores = torch.full((length,), float("-inf"))
    scores[:prefix] = votes.float().cpu()
    scores[must] = float("inf")
    n = min(length, max(keep, int(must.sum())))
    return scores.topk(n).indices.sort().values


class LayerSplit:
    """The layer-split prefill of one prompt on ``model`` at layer ``s`` (``layer``)."""

    def __init__(self, model: Any, cache_kwarg: str, layer: int) -> None:
        self.model = model
        self.cache_kwarg = cache_kwarg
        self.layer = layer
        inner = model.model
        self.inner = inner
        self.layers = list(inner.layers)
        self.config = getattr(model.config, "get_text_config", lambda: model.config)()
        self.windows = sliding_windows(model.config)
        self.types = list(
            getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        )
        rotary_params = inspect.signature(type(inner.rotary_emb).forward).parameters
        self.rotary_per_type = "layer_type" in rotary_params
        self.hidden: list[torch.Tensor] = []  # the lower passes' outputs, [1, q, H] each
        self.votes: torch.Tensor | None = None
        self._vote_args: tuple[int, int, str] | None = None
        self._running = False

    @property
    def upper_slides(self) -> bool:
        """Whether a layer ``>= s`` has a sliding window (its cache keeps only recent
        positions, so the propagated tokens run in one pass)."""
        return any(w is not None for w in self.windows[self.layer :])

    @contextmanager
    def installed(self) -> Iterator[LayerSplit]:
        """The stop hook on decoder layer ``s - 1`` and the vote hook on its attention,
        registered before any press hook (so the vote sees the layer's full KV)."""
        attention = attention_modules(self.model)[self.layer - 1]
        handles = [
            self.layers[self.layer - 1].register_forward_hook(self._stop_hook),
            attention.register_forward_hook(self._vote_hook, with_kwargs=True),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _stop_hook(self, module: Any, args: tuple, output: Any) -> None:
        if self._running:
            hidden = output[0] if isinstance(output, tuple) else output
            raise _Stop(hidden)

    def _vote_hook(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if not self._running or self._vote_args is None:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        assert cache is not None, "the lower pass runs with a cache"
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        layer_cache = cache.layers[self.layer - 1]
        context = LayerContext(
            layer_idx=self.layer - 1,
            num_layers=len(self.layers),
            module=module,
            keys=layer_cache.keys,
            values=layer_cache.values,
            hidden_states=hidden_states,
            position_embeddings=kwargs["position_embeddings"],
        )
        with torch.no_grad():
            self.votes = token_votes(context, *self._vote_args)

    @torch.inference_mode()
    def lower(
        self,
        token_ids: Sequence[int],
        cache: Any,
        start: int,
        vote: tuple[int, int, str] | None = None,
    ) -> None:
        """Run ``token_ids`` at positions ``start..`` through layers ``0 .. s-1`` on top of
        ``cache``, keeping layer ``s - 1``'s output; with ``vote`` (``(window, kernel,
        pooling)``, on the last chunk) the window votes at layer ``s - 1``."""
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(token_ids)], device=device)
        positions = torch.arange(start, start + ids.shape[1], device=device).unsqueeze(0)
        self._vote_args = vote
        self._running = True
        try:
            self.inner(
                input_ids=ids, position_ids=positions, use_cache=True, **{self.cache_kwarg: cache}
            )
        except _Stop as stop:
            self.hidden.append(stop.hidden)
        else:  # pragma: no cover - the hook always stops the pass
            raise RuntimeError(f"the lower pass did not stop at layer {self.layer - 1}")
        finally:
            self._running = False
            self._vote_args = None

    def propagated_count(self, length: int, share: float, need: int) -> int:
        """How many of ``length`` tokens propagate at share ``p`` (at least ``need``)."""
        return min(length, max(math.ceil(share * length), need))

    def gathered(self, positions: torch.Tensor) -> torch.Tensor:
        """Layer ``s - 1``'s output at ``positions`` (``[n]``): ``[1, n, H]``."""
        hidden = torch.cat(self.hidden, dim=1) if len(self.hidden) > 1 else self.hidden[0]
        self.hidden = []
        return hidden.index_select(1, positions.to(hidden.device))

    @torch.inference_mode()
    def upper(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        begin: int,
        end: int,
    ) -> torch.Tensor:
        """Run the propagated tokens ``begin:end`` through layers ``s .. L-1``.

        Parameters
        ----------
        hidden : ``[1, n, H]`` layer ``s - 1``'s output of every propagated token.
        positions : ``[n]`` their original positions, ascending.
        cache : the model cache; layer ``l >= s`` holds the first ``begin`` propagated
            tokens and receives these.

        Returns
        -------
        ``[1, V]`` logits of the pass's last token.
        """
        device = hidden.device
        x = hidden[:, begin:end]
        pos = positions[begin:end].to(device).unsqueeze(0)  # [1, q]
        q = end - begin
        # query i sees the propagated tokens up to itself (ascending positions)
        causal = torch.ones(q, begin + q, dtype=torch.bool, device=device).tril(begin)
        # a first pass needs no mask: transformers then runs sdpa with is_causal, as the
        # full path's first chunk does (same kernel, same rounding)
        masks = {"full_attention": None if begin == 0 else causal[None, None]}
        if any(w is not None for w in self.windows[self.layer :]):
            keys_pos = positions[:end].to(device)
            near = pos[0].unsqueeze(1) - keys_pos.unsqueeze(0)  # [q, begin + q]
            window = next(w for w in self.windows[self.layer :] if w is not None)
            masks["sliding_attention"] = (causal & (near < window))[None, None]
        embeddings: dict[str, Any] = {}
        for i in range(self.layer, len(self.layers)):
            kind = "full_attention" if self.windows[i] is None else "sliding_attention"
            rope_type = self.types[i]
            if rope_type not in embeddings:
                embeddings[rope_type] = (
                    self.inner.rotary_emb(x, pos, rope_type)
                    if self.rotary_per_type
                    else self.inner.rotary_emb(x, pos)
                )
            x = self.layers[i](
                x,
                attention_mask=masks[kind],
                position_embeddings=embeddings[rope_type],
                position_ids=pos,
                use_cache=True,
                **{self.cache_kwarg: cache},
            )
            if isinstance(x, tuple):
                x = x[0]
        return self.logits(x[:, -1:])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[1, V]`` logits of ``hidden`` ``[1, 1, H]`` (final norm, head, soft-capping)."""
        out = self.model.lm_head(self.inner.norm(hidden))[:, -1, :]
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            out = torch.tanh(out / cap) * cap
        return out


HEADER_TOKENS = 32  # the most tokens of a document's header line that always propagate


def forced_positions(tokenizer: Any, layout: Any) -> torch.Tensor:
    """``[L]`` bool: the positions a query-aware prefill always propagates besides the
    window: the prompt head before the first document (the system instruction and the
    template's start) and each document's header line (``[n] title``, up to its first
    newline, at most :data:`HEADER_TOKENS` tokens)."""
    forced = torch.zeros(layout.num_tokens, dtype=torch.bool)
    spans = list(layout.doc_spans)
    head_end = spans[0][0] if spans else layout.prefix_len
    forced[:head_end] = True
    for begin, end in spans:
        stop = min(end, begin + HEADER_TOKENS)
        for i in range(begin, stop):
            forced[i] = True
            if "\n" in tokenizer.decode([layout.input_ids[i]]):
                break
    return forced
