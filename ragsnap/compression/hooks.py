"""Forward hooks that run presses on every attention layer at the end of prefill.

Nothing is patched: hooks are registered on the attention modules inside a context
manager and removed in ``finally``. A hook compresses only while the recorder is
``armed``, so the same model serves prefill, decoding and teacher forcing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ragsnap.compression.base import CompressedLayer, LayerContext, Press, project_queries

# the recorder of the prefill running in this thread: hooks are installed on the shared
# model, so another thread's forward pass (a decode step, another prefill) must not fire them
_CURRENT: ContextVar[CompressionRecorder | None] = ContextVar("ragsnap_recorder", default=None)


def attention_modules(model: nn.Module) -> list[Any]:
    """The self-attention modules of a decoder, in layer order (those with ``q_proj`` and ``layer_idx``)."""
    found: list[Any] = [
        m
        for m in model.modules()
        if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    if not found:
        raise RuntimeError(
            f"no attention modules with q_proj/layer_idx found in {type(model).__name__}"
        )
    return sorted(found, key=lambda m: int(m.layer_idx))


def _cache_from(kwargs: dict[str, Any]) -> Any:
    # transformers 5.24 renamed the attention kwarg past_key_values -> cache
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        raise RuntimeError(
            "the attention hook saw no KV cache: this transformers version passes it under "
            "another name; ragsnap supports transformers>=5.4,<5.40"
        )
    return cache


@dataclass
class CompressionRecorder:
    """Collects what each press kept, per layer, during one armed forward pass.

    ``results[p][layer]`` is press ``p``'s :class:`CompressedLayer` for that layer.
    With ``apply=True`` the first press's result replaces the layer's cache entries in place.
    """

    presses: Sequence[Press]
    apply: bool
    num_layers: int
    armed: bool = False
    seconds: float = 0.0
    bytes_seen: int = 0  # keys + values of every layer before compression
    results: list[dict[int, CompressedLayer]] = field(default_factory=list)
    press_seconds: list[float] = field(default_factory=list)
    skipped_layers: set[int] = field(default_factory=set)
    word_starts: torch.Tensor | None = None  # [L] bool, for presses that complete words
    roles: torch.Tensor | None = None  # [L] uint8 token roles, for role-conditioned presses
    focus: torch.Tensor | None = None  # [L] uint8 tiers of the named record, for LookupFocusPress
    # layer -> [B, Hq, k, D] queries of the tokens drafted after the prompt, for LookaheadPress
    drafted: dict[int, torch.Tensor] | None = None
    # deferred: the armed pass only keeps each layer's input (its last ``keep_rows`` rows,
    # all when None) and :meth:`compress_pending` compresses later (after a draft)
    deferred: bool = False
    keep_rows: int | None = None
    pending: dict[int, tuple[Any, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )
    # layer -> [n] original positions of the entries its cache holds, where these are not
    # 0 .. L-1 (query-aware prefill: the layers past the split hold the propagated tokens);
    # the press then sees the per-position inputs at those positions and kept indices are
    # mapped back to original positions
    positions: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.results = [{} for _ in self.presses]
        self.press_seconds = [0.0 for _ in self.presses]

    def layer_results(self, press_index: int = 0) -> list[CompressedLayer]:
        """One press's results in layer order (layers that were skipped are absent)."""
        res = self.results[press_index]
        return [res[i] for i in sorted(res)]

    def layer_bias(self, press_index: int = 0) -> dict[int, torch.Tensor]:
        """Layer index -> ``[B, Hkv, n]`` logit bias, for the layers where the press set one."""
        res = self.results[press_index]
        return {i: c.bias for i, c in res.items() if c.bias is not None}

    def hook(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if not self.armed or _CURRENT.get() is not self:
            return
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        position_embeddings = kwargs["position_embeddings"]
        if self.deferred:
            rows = -(self.keep_rows or hidden_states.shape[1])
            cos, sin = position_embeddings
            self.pending[int(module.layer_idx)] = (
                module,
                hidden_states[:, rows:].clone(),
                (cos[:, rows:].clone(), sin[:, rows:].clone()),
            )
            return
        self._compress(module, _cache_from(kwargs), hidden_states, position_embeddings)

    def compress_pending(self, cache: Any, drafted: dict[int, torch.Tensor] | None) -> None:
        """Compress every layer the deferred pass kept, on ``cache`` as it is now (cut back
        to the prompt), with ``drafted`` queries (layer -> ``[B, Hq, k, D]``) voting."""
        self.drafted = drafted
        for module, hidden_states, position_embeddings in self.pending.values():
            self._compress(module, cache, hidden_states, position_embeddings)
        self.pending.clear()

    def _compress(
        self,
        module: Any,
        cache: Any,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        layer_idx = int(module.layer_idx)
        layer_cache = cache.layers[layer_idx]
        total = cache.get_seq_length(layer_idx)
        keys, values = layer_cache.keys, layer_cache.values
        self.bytes_seen += keys.nbytes + values.nbytes
        if getattr(layer_cache, "is_sliding", False) or keys.shape[-2] != total:
            # A sliding-window layer already bounds its own cache (Gemma3, Mistral SWA), and
            # its masks count positions (cumulative_length), so evicting from it, even before
            # it slides, breaks decoding: leave it whole.
            self.skipped_layers.add(layer_idx)
            return
        started = time.perf_counter()
        held = self.positions.get(layer_idx)
        context = LayerContext(
            layer_idx=layer_idx,
            num_layers=self.num_layers,
            module=module,
            keys=keys,
            values=values,
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            word_starts=_at(self.word_starts, held),
            roles=_at(self.roles, held),
            focus=_at(self.focus, held),
            drafted=None if self.drafted is None else self.drafted.get(layer_idx),
        )
        with torch.no_grad():
            for i, press in enumerate(self.presses):
                press_started = time.perf_counter()
                kept = press.compress(context)
                if held is not None:  # entry i of this layer is position held[i]
                    kept.indices = held.to(kept.indices.device)[kept.indices]
                self.results[i][layer_idx] = kept
                self.press_seconds[i] += time.perf_counter() - press_started
            if self.apply:
                kept = self.results[0][layer_idx]
                layer_cache.keys, layer_cache.values = kept.keys, kept.values
        if keys.is_cuda:
            torch.cuda.synchronize(keys.device)
        self.seconds += time.perf_counter() - started


def _at(per_position: torch.Tensor | None, held: torch.Tensor | None) -> torch.Tensor | None:
    """``per_position`` (``[L]``) at the positions ``held`` (``[n]``), or as it is."""
    if per_position is None or held is None:
        return per_position
    return per_position[held.to(per_position.device)]


@contextmanager
def compression_hooks(
    model: nn.Module,
    presses: Press | Sequence[Press],
    *,
    apply: bool = True,
    word_starts: torch.Tensor | None = None,
    roles: torch.Tensor | None = None,
    focus: torch.Tensor | None = None,
    deferred: bool = False,
    keep_rows: int | None = None,
) -> Iterator[CompressionRecorder]:
    """Install press hooks on every attention layer of ``model`` for the duration of the block.

    Arm the yielded recorder (``recorder.armed = True``) around the forward pass whose end
    is the end of prefill; its results hold what each press kept. With several presses and
    ``apply=False`` one prefill serves them all (the cache itself stays full).
    ``word_starts``, ``roles`` and ``focus`` (``[L]`` each) describe the prompt's positions
    to presses. ``deferred=True`` keeps each layer's input (its last ``keep_rows`` rows)
    instead of compressing; :meth:`CompressionRecorder.compress_pending` compresses later,
    with the queries of tokens drafted after the prompt (:func:`query_capture`).
    """
    press_list = [presses] if isinstance(presses, Press) else list(presses)
    if apply and len(press_list) != 1:
        raise ValueError("apply=True needs exactly one press")
    modules = attention_modules(model)
    recorder = CompressionRecorder(
        press_list,
        apply=apply,
        num_layers=len(modules),
        word_starts=word_starts,
        roles=roles,
        focus=focus,
        deferred=deferred,
        keep_rows=keep_rows,
    )
    with _hooked(modules, recorder.hook, _CURRENT, recorder):
        yield recorder


@contextmanager
def _hooked(
    modules: Sequence[Any], hook: Any, current: ContextVar[Any], owner: Any
) -> Iterator[None]:
    """``hook`` after every module of ``modules``, with ``owner`` as this thread's
    ``current`` (hooks check it, so other threads' forward passes do not fire them)."""
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    token = current.set(owner)
    try:
        yield
    finally:
        current.reset(token)
        for handle in handles:
            handle.remove()


# the query capture of this thread's draft, if any (same reason as _CURRENT)
_CAPTURE: ContextVar[dict[int, list[torch.Tensor]] | None] = ContextVar(
    "ragsnap_query_capture", default=None
)


@contextmanager
def query_capture(model: nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Record, per layer, the queries (RoPE applied, ``[B, Hq, q, D]`` float) of every
    forward pass this thread runs on ``model`` inside the block, in the order they ran."""
    captured: dict[int, list[torch.Tensor]] = {}

    def hook(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if _CAPTURE.get() is not captured:
            return
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        queries = project_queries(module, hidden_states, kwargs["position_embeddings"])
        captured.setdefault(int(module.layer_idx), []).append(queries.float())

    with _hooked(attention_modules(model), hook, _CAPTURE, captured):
        yield captured
