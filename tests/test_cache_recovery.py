"""What a stolen cache entry gives away (issue 40): layer-0 values depend on the token
alone, so matching an entry's bytes against every vocabulary token's layer-0 value reads
the prompt back. A plaintext entry gives the prompt up; a default (sealed) one nothing."""

from __future__ import annotations

from pathlib import Path

import torch

from ragsnap.cache import open_store
from ragsnap.compression import SnapKVPress
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.tiny_models import HEAD_DIM, KV_HEADS, VOCAB, tiny_engine


def token_values(model: torch.nn.Module) -> torch.Tensor:
    """``[VOCAB * KV_HEADS, HEAD_DIM]``: each token's layer-0 value, per KV head."""
    layer = model.model.layers[0]
    with torch.no_grad():
        hidden = layer.input_layernorm(model.get_input_embeddings().weight)
        return layer.self_attn.v_proj(hidden).reshape(VOCAB * KV_HEADS, HEAD_DIM)


def recovered_tokens(blob: bytes, values: torch.Tensor) -> set[int]:
    """Token ids whose layer-0 value appears anywhere in ``blob`` as float32 (any offset)."""
    found: set[int] = set()
    tolerance = 1e-4 * float(values.norm(dim=1).mean())
    for offset in range(4):
        count = (len(blob) - offset) // 4
        if count < HEAD_DIM:  # too short to hold a vector (a document set's seen marker)
            continue
        floats = torch.frombuffer(bytearray(blob[offset : offset + 4 * count]), dtype=torch.float32)
        windows = floats.unfold(0, HEAD_DIM, 1)
        windows = windows[torch.isfinite(windows).all(dim=1) & (windows.abs() < 1e4).all(dim=1)]
        for part in windows.split(8192):
            distance, nearest = torch.cdist(part.double(), values.double()).min(dim=1)
            found |= set((nearest[distance < tolerance] // KV_HEADS).tolist())
    return found


def stored_entries(root: Path) -> list[bytes]:
    return [path.read_bytes() for path in root.rglob("*.kv")]


def test_a_default_entry_gives_no_token_back_where_a_plaintext_one_gives_the_prompt(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("RAGSNAP_CACHE_KEY", raising=False)  # no configuration at all
    tiny = tiny_engine("llama")
    values = token_values(tiny.loaded.model)
    text = " ".join(f"t{2 + (7 * i) % 90}" for i in range(90))
    docs = [Document(id="secret", title="t3", text=text)]
    options = AnswerOptions(SnapKVPress(budget=32, window=8), GenerationConfig(max_new_tokens=3))
    prompt_tokens = {int(t[1:]) for t in text.split()}
    recovered = {}
    for name, url in (("plain", "?unsealed=1"), ("default", "")):
        root = tmp_path / name
        engine = RagSnapEngine(tiny.loaded, store=open_store(f"file://{root}{url}"))
        engine.answer("t5 t6 t7", docs, options)
        entries = stored_entries(root)
        assert entries, "no entry was stored"
        recovered[name] = set().union(*(recovered_tokens(blob, values) for blob in entries))
    # the attack works: a plaintext store gives the document back (all 90 tokens here)
    assert len(recovered["plain"] & prompt_tokens) >= len(prompt_tokens) // 2
    assert recovered["default"] == set()
