"""Word boundaries of a tokenized prompt, and carrying scores along words."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# How byte-level BPE (GPT-2, Llama 3, SmolLM) and SentencePiece spell leading whitespace.
_WHITESPACE_MARKERS = str.maketrans({"Ġ": " ", "Ċ": "\n", "ĉ": "\t", "▁": " "})


def word_starts(tokenizer: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """``[L]`` bool: True where a token begins a whitespace-delimited word.

    A token starts a word when it begins with whitespace or follows a token that ends
    with whitespace, unless the previous token is whitespace only (a lone space or newline
    token opens the word that follows it). Digits, punctuation and sub-word pieces glued
    to the previous token continue its word: ``" 7007071."`` is one word of nine tokens.
    """
    pieces = [
        (tok or "").translate(_WHITESPACE_MARKERS)
        for tok in tokenizer.convert_ids_to_tokens(list(token_ids))
    ]
    starts = [True] * len(pieces)
    for i in range(1, len(pieces)):
        previous = pieces[i - 1]
        after_space = pieces[i][:1].isspace() or previous[-1:].isspace()
        starts[i] = after_space and not (previous and previous.isspace())
    return torch.tensor(starts, dtype=torch.bool)


def segment_ids(starts: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """``[L]`` long: a segment id per position; words longer than ``max_tokens`` are split."""
    word = (starts.long().cumsum(0) - 1).clamp(min=0)
    position = torch.arange(starts.shape[0], device=starts.device)
    word_start = torch.zeros_like(position).scatter_reduce(
        0, word, position, reduce="amin", include_self=False
    )[word]
    return word * max_tokens + (position - word_start) // max_tokens


def carry_forward(scores: torch.Tensor, segments: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Running max of ``scores`` (``[B, H, n]``) from the start of each segment (``[n]``).

    Every token gets at least the score of the earlier tokens of its word, so a kept word
    start keeps the rest of the word. One vectorized step per offset (at most ``max_tokens - 1``).
    """
    carried = scores.clone()
    for offset in range(1, min(max_tokens, scores.shape[-1])):
        same = (segments[offset:] == segments[:-offset]).to(scores.device)
        earlier = scores[..., :-offset]
        carried[..., offset:] = torch.where(
            same, torch.maximum(carried[..., offset:], earlier), carried[..., offset:]
        )
    return carried
