"""Tiny random decoder models built from transformers configs, for fast unit tests.

Every architecture uses GQA (4 query heads over 2 KV heads, head_dim 16). Weights are
initialised with a large ``initializer_range`` so attention is peaked rather than nearly
uniform: that makes SnapKV scores well separated and the selection meaningful.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from ragsnap.engine.engine import RagSnapEngine
from ragsnap.runtime.loading.models import LoadedModel

VOCAB = 96
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
GEMMA3_SLIDING_WINDOW = 16
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=1024,
    initializer_range=0.25,
    tie_word_embeddings=False,
)


def tiny_config(arch: str, **overrides):
    """A transformers config for a 4-layer GQA model of ``arch`` (``overrides`` win)."""
    common = {**_COMMON, **overrides}
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**{"sliding_window": None, **common})
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "gemma3":
        # layers 0 and 2 slide over 16 tokens, 1 and 3 attend to everything; a query scale
        # different from head_dim checks that presses use the model's own softmax scale
        return Gemma3TextConfig(
            **{
                "sliding_window": GEMMA3_SLIDING_WINDOW,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "query_pre_attn_scalar": 24,
                **common,
            }
        )
    raise ValueError(arch)


def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised ``arch`` model in eval mode using attention ``attn``."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A real word-level tokenizer: ``<unk>`` (0), ``</s>`` (1, EOS), then ``t2 .. t{VOCAB-1}``."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def tiny_engine(
    arch: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides
) -> RagSnapEngine:
    """A :class:`RagSnapEngine` around a tiny random model (token ids in, no chat template)."""
    model = tiny_model(arch, attn, seed, **overrides)
    loaded = LoadedModel(
        model=model,
        tokenizer=tiny_tokenizer(),
        model_id=f"tiny-{arch}",
        revision="random",
        device=torch.device("cpu"),
    )
    # plain decoding: drafting is tested where a test turns it on
    return RagSnapEngine(loaded, speculate=0, speculate_ngrams=False, commit_lookahead=False)


def random_prompt(length: int, seed: int = 0) -> list[int]:
    """``length`` token ids avoiding EOS (id 1)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(2, VOCAB, (length,), generator=generator)).tolist()


def save_tiny_model(path, arch: str = "llama", seed: int = 0, eos: bool = False) -> str:
    """Save a tiny random ``arch`` model and its tokenizer to ``path`` (a directory that
    ``--model`` loads, in another process too); without ``eos`` the tokenizer has no end
    token, so every answer runs to ``max_new_tokens``."""
    model = tiny_model(arch, "sdpa", seed)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer = tiny_tokenizer()
    if not eos:
        tokenizer.eos_token = None
    tokenizer.save_pretrained(path)
    return str(path)
