"""Decoding settings and next-token selection."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ragsnap.errors import ConfigError

MAX_TEMPERATURE = 2.0  # OpenAI's limit; the API, the CLI and the engine share it
# below this the softmax of logits / temperature is one-hot in float32: greedy is the limit
GREEDY_BELOW = 1e-4
# a signed 64-bit integer, within what torch.Generator.manual_seed takes
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


DEFAULT_MAX_NEW_TOKENS = 128  # the longest answer, in tokens, of a request that says none


@dataclass(frozen=True)
class GenerationConfig:
    """Greedy by default; ``temperature > 0`` samples (nucleus ``top_p``, reproducible with ``seed``)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[
        str, ...
    ] = ()  # the answer ends before the first of these (ragsnap.engine.stopping)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1", field="max_new_tokens")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ConfigError(
                f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}",
                field="temperature",
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ConfigError(
                f"seed must be between {SEED_MIN} and {SEED_MAX} (64 bits)", field="seed"
            )
        if len(self.stop) > 4 or any(not s or len(s) > 256 for s in self.stop):
            raise ConfigError(
                "stop: at most 4 non-empty strings of <= 256 characters", field="stop"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class TokenSampler:
    """Picks the next token from ``[1, V]`` logits according to a :class:`GenerationConfig`."""

    def __init__(self, config: GenerationConfig, device: torch.device) -> None:
        self.config = config
        self.generator: torch.Generator | None = None
        if not config.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(config.seed if config.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token id from ``logits`` ``[1, V]``."""
        if self.config.greedy:
            return int(logits[0].argmax())
        row = logits[0].float()
        # shift by the max first: the scaled logits stay finite for any temperature
        probs = ((row - row.max()) / self.config.temperature).softmax(-1)
        if self.config.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # drop tokens once the mass before them already reaches top_p (the first always stays)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= self.config.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        total = float(probs.sum())
        if not math.isfinite(total) or total <= 0.0:  # NaN logits from the model: no sample
            return int(row.nan_to_num(nan=float("-inf")).argmax())
        return int(torch.multinomial(probs, 1, generator=self.generator))


def stop_token_ids(tokenizer: Any, model: Any) -> set[int]:
    """End-of-turn tokens: the tokenizer's EOS, the generation config's EOS list, ``<|im_end|>``/``<|eot_id|>``."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, eos):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"):
        if token in vocab:
            ids.add(vocab[token])
    return ids
