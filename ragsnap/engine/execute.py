"""A cache plan executed with the model: one path per kind of hit.

The cache tiers plan (:mod:`ragsnap.cache.tiers.plans`); this module computes what the plan
leaves to compute with the runtime's primitives (prefill of a span, tails over a prefix,
blend, compress) and hands the tiers what to store. :meth:`PlanExecutor.execute` is a
generator of :class:`~ragsnap.runtime.prefill.ChunkStep` that yields before each prefill
chunk (and :class:`~ragsnap.runtime.prefill.PromptLogits` once the last logits exist, before
the draft and compression): the in-process path drives it to its end, the scheduler
interleaves it with decode steps, so every entrance runs the same computation for the same
plan, and sends a greedy answer's first token at the same point.

exact hit     the stored compressed cache; no pass.
prefix hit    the tail over the loaded prefix (:mod:`ragsnap.runtime.tails`; several hits
              in shared passes: :meth:`PlanExecutor.finish_prefix_hits`).
document hit  the prefix assembled from the pieces with a share recomputed
              (:func:`ragsnap.runtime.blend.blend_prefix`), then the tail on it.
cold          the document prefix's full pass, then the tail on it (the prefix goes to the
              tiers: later questions reuse it); or, with no split, the prompt whole.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ragsnap.cache.report import CacheReport
from ragsnap.cache.tiers.plans import Cold, DocumentHit, ExactHit, Lookup, Plan, PrefixHit
from ragsnap.compression import Press
from ragsnap.compression.lookup_focus import uses_focus
from ragsnap.compression.propagate import propagation_of
from ragsnap.prompt.assembly import PromptLayout
from ragsnap.prompt.focus import prompt_focus
from ragsnap.prompt.structure import prompt_roles
from ragsnap.runtime.blend import PlacedPiece
from ragsnap.runtime.forward import DraftPass
from ragsnap.runtime.kv import cache_nbytes, crop_layers
from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.prefill import PrefillResult, PromptLogits, Step, drain, tail_start
from ragsnap.runtime.tails import Tail

if TYPE_CHECKING:
    import torch

    from ragsnap.cache.tiers.cached_prefill import CachedPrefill

Layers = list[tuple["torch.Tensor", "torch.Tensor"]]


@dataclass
class PlannedPrompt:
    """A prompt, its press and the plan the tiers gave it (None: no tiers, computed whole)."""

    layout: PromptLayout
    press: Press
    plan: Plan | None
    namespace: str | None = None


class PlanExecutor:
    """Executes plans on ``runtime`` and stores their results in ``tiers`` (when given);
    a document hit recomputes ``share`` of its pieces' tokens chosen per ``select``."""

    def __init__(
        self,
        runtime: ModelRuntime,
        tiers: CachedPrefill | None,
        share: float,
        select: str,
    ) -> None:
        self.runtime, self.tiers, self.share, self.select = runtime, tiers, share, select
        # the last prompt head's KV: every prompt of a template starts with the same head
        self._head: tuple[tuple[int, ...], Layers] | None = None

    def plan(
        self, layout: PromptLayout, press: Press, question: str, namespace: str | None
    ) -> PlannedPrompt:
        """What the cache tiers hold for ``layout`` (a data-only plan; nothing computed)."""
        if self.tiers is None:
            return PlannedPrompt(layout, press, None, namespace)
        lookup = Lookup(
            press_config=press.config(),
            question=question,
            namespace=namespace,
            split=tail_start(layout, press),
            propagates=propagation_of(press) is not None and press.window_only,
        )
        return PlannedPrompt(layout, press, self.tiers.plan(layout, lookup), namespace)

    def prefill(
        self, layout: PromptLayout, press: Press, question: str, namespace: str | None
    ) -> tuple[PrefillResult, CacheReport]:
        """The prompt's compressed cache through the tiers, in this thread, and what the
        tiers did (its entries are left for :meth:`CachedPrefill.finish`)."""
        prompt = self.plan(layout, press, question, namespace)
        result = drain(self.execute(prompt))
        report = CacheReport(status="off") if prompt.plan is None else prompt.plan.report
        return result, report

    def execute(
        self, prompt: PlannedPrompt, chunk: int | None = None
    ) -> Generator[Step, None, PrefillResult]:
        """The prompt's compressed cache: a :class:`ChunkStep` before each prefill chunk of
        ``chunk`` tokens (None: the runtime's) and :class:`PromptLogits` once the last
        logits exist, the result at the end."""
        plan, tiers = prompt.plan, self.tiers
        if plan is None or tiers is None:
            return (yield from self._whole(prompt, chunk))
        if isinstance(plan, ExactHit):
            return self.from_stored(plan)
        if isinstance(plan, PrefixHit):
            results = yield from self.finish_prefix_hits([prompt])
            return results[0]
        with tiers.computing(plan) as stored:  # one request computes an entry
            if stored is not None:
                return self.from_stored(stored)
            if isinstance(plan, Cold) and plan.split <= 0:
                result = yield from self._whole(prompt, chunk)
            else:
                result = yield from self._on_prefix(prompt, plan, chunk)
            tiers.store_result(plan, result)
        return result

    def from_stored(self, hit: ExactHit) -> PrefillResult:
        """The decodable result of an exact hit (no forward pass)."""
        stored = hit.stored
        cache = self.runtime.cache_from(stored.layers)
        return PrefillResult(
            cache=cache,
            original_length=stored.original_length,
            next_logits=stored.next_logits,
            kept=stored.kept,
            press_config=stored.press_config,
            prefill_s=0.0,
            compress_s=0.0,
            kv_bytes_full=stored.kv_bytes_full,
            kv_bytes_kept=cache_nbytes(cache),
            processed_tokens=0,
            bias=stored.decode_bias,
            draft=stored.draft,
        )

    def finish_prefix_hits(
        self, prompts: Sequence[PlannedPrompt]
    ) -> Generator[PromptLogits | DraftPass, None, list[PrefillResult]]:
        """Finish prefix hits in shared passes where they batch (one result per prompt;
        prompts of the same entry share one); an entry another request stored meanwhile is
        loaded instead. Shared passes yield the prompts' last logits (``[len(prompts),
        V]``, :class:`PromptLogits`) before their draft and compression, then each draft
        pass (:class:`DraftPass`, which its driver may compute beside other rows)."""
        assert self.tiers is not None, "prefix hits come from the cache tiers"
        unique = list({self._hit(p).key: p for p in prompts}.values())
        results: dict[object, PrefillResult] = {}
        hits = [self._hit(p) for p in unique]
        with self.tiers.computing_many(hits) as stored:
            todo = []
            for prompt, hit, found in zip(unique, hits, stored, strict=True):
                if found is not None:
                    results[hit.key] = self.from_stored(found)
                else:
                    todo.append((prompt, hit))
            tails = [self._tail(prompt, hit) for prompt, hit in todo]
            runtime = self.runtime
            if runtime.tails_batchable(tails):
                row = {hit.key: r for r, (_, hit) in enumerate(todo)}
                rows = [
                    row[key] if key in row else results[key].next_logits
                    for key in (self._hit(p).key for p in prompts)
                ]
                computed = yield from _in_prompt_order(runtime.prefill_tails_steps(tails), rows)
            else:  # each alone: in shared passes where it can, else by the chunked prefill
                computed = [
                    runtime.prefill_tails([t])[0]
                    if runtime.tails_batchable([t])
                    else self._alone(t)
                    for t in tails
                ]
            for (_, hit), result in zip(todo, computed, strict=True):
                results[hit.key] = result
                self.tiers.store_result(hit, result)
        return [results[self._hit(p).key] for p in prompts]

    # -- the paths -----------------------------------------------------------------------

    def _whole(
        self, prompt: PlannedPrompt, chunk: int | None
    ) -> Generator[Step, None, PrefillResult]:
        layout, press = prompt.layout, prompt.press
        roles, focus = self._described(layout, press)
        return (
            yield from self.runtime.prefill_prompt_steps(
                layout, press, chunk=chunk, roles=roles, focus=focus
            )
        )

    def _on_prefix(
        self, prompt: PlannedPrompt, plan: Cold | DocumentHit, chunk: int | None
    ) -> Generator[Step, None, PrefillResult]:
        """The document prefix computed (cold) or assembled (document hit), kept by the
        tiers, then the tail prefilled on it from ``plan.split``."""
        layout, press = prompt.layout, prompt.press
        started = time.perf_counter()
        if isinstance(plan, DocumentHit):
            prefix, tokens = self._assemble(layout, plan)
            plan.report.recomputed_tokens = tokens
        else:
            prefix = yield from self.runtime.prefill_full_steps(
                layout.input_ids[: layout.prefix_len], chunk
            )
            tokens = layout.prefix_len
        prefix_s = time.perf_counter() - started
        assert self.tiers is not None
        self.tiers.store_prefix(plan, layout, prefix, prompt.namespace)
        roles, focus = self._described(layout, press)
        result = yield from self.runtime.prefill_steps(
            layout.input_ids,
            press,
            cache=self.runtime.cache_from(crop_layers(prefix, plan.split)),
            start=plan.split,
            chunk=chunk,
            roles=roles,
            focus=focus,
        )
        result.prefill_s += prefix_s  # the figures cover both passes
        result.processed_tokens += tokens
        return result

    def _assemble(self, layout: PromptLayout, plan: DocumentHit) -> tuple[Layers, int]:
        """The document prefix of ``layout`` from ``plan``'s pieces, and how many of its
        positions were recomputed."""
        head_ids = tuple(layout.input_ids[: plan.head_len])
        if self._head is None or self._head[0] != head_ids:
            self._head = (head_ids, self.runtime.head_kv(head_ids))
        placed = [PlacedPiece(p.layers, p.base, p.start) for p in plan.pieces]
        blend = self.runtime.blend_prefix(
            layout.input_ids[: layout.prefix_len],
            plan.head_len,
            placed,
            self.share,
            self.select,
            layout.input_ids[layout.prefix_len :],
            self._head[1],
        )
        return blend.layers, len(blend.recomputed)

    def _alone(self, tail: Tail) -> PrefillResult:
        """A tail that batches with nothing (a sliding-window model), prefilled alone."""
        steps = self.runtime.prefill_steps(
            tail.input_ids,
            tail.press,
            cache=self.runtime.cache_from(crop_layers(list(tail.prefix), tail.start)),
            start=tail.start,
            roles=tail.roles,
            focus=tail.focus,
        )
        result: PrefillResult = drain(steps)
        return result

    def _tail(self, prompt: PlannedPrompt, hit: PrefixHit) -> Tail:
        roles, focus = self._described(prompt.layout, prompt.press)
        return Tail(
            prompt.layout.input_ids, hit.prefix, hit.split, prompt.press, roles=roles, focus=focus
        )

    @staticmethod
    def _hit(prompt: PlannedPrompt) -> PrefixHit:
        assert isinstance(prompt.plan, PrefixHit), "not a prefix hit"
        return prompt.plan

    def _described(
        self, layout: PromptLayout, press: Press
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt's roles and, for a press that uses it, its lookup focus (``[L]`` each)."""
        tokenizer = self.runtime.tokenizer
        focus = prompt_focus(tokenizer, layout) if uses_focus(press) else None
        return prompt_roles(tokenizer, layout), focus


def _in_prompt_order(
    steps: Generator[PromptLogits | DraftPass, None, list[PrefillResult]],
    rows: list[int | torch.Tensor],
) -> Generator[PromptLogits | DraftPass, None, list[PrefillResult]]:
    """``steps``' logits again, one row per prompt: prompt ``i``'s row ``rows[i]`` of the
    computed tails, or its own logits ``[1, V]`` (an entry loaded); their draft passes as
    they are; returns their results."""
    try:
        while True:
            try:
                step = next(steps)
            except StopIteration as finished:
                results: list[PrefillResult] = finished.value
                return results
            if isinstance(step, DraftPass):
                yield step
                continue
            yield PromptLogits(
                torch.cat([step.logits[r : r + 1] if isinstance(r, int) else r for r in rows])
            )
    finally:
        steps.close()
