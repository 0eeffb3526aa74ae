"""Converted GGUF weights: kept after the first load, read by later ones, rebuilt when damaged."""

from __future__ import annotations

import shutil

import pytest
import torch

from ragsnap.runtime.loading import converted_weights, models
from ragsnap.runtime.loading.models import embedded_model_path, load_model


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("RAGSNAP_MODEL_CACHE", "off")
    assert converted_weights.converted_folder(embedded_model_path()) is None


def test_the_folder_names_the_file_it_came_from(monkeypatch, tmp_path):
    monkeypatch.setenv("RAGSNAP_MODEL_CACHE", str(tmp_path))
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"x")
    first = converted_weights.converted_folder(gguf)
    gguf.write_bytes(b"xy")  # another file under the same name
    assert first is not None and first.parent == tmp_path
    assert converted_weights.converted_folder(gguf) != first


def _last_logits(loaded) -> torch.Tensor:
    ids = loaded.tokenizer("The Rosetta Stone is kept in", return_tensors="pt").input_ids
    with torch.no_grad():
        return loaded.model(ids).logits[0, -1]


@pytest.mark.model
def test_later_loads_read_the_converted_folder_and_a_damaged_one_is_rebuilt(
    engine, monkeypatch, tmp_path
):
    # the session's engine load converted the GGUF into the run's private model cache
    session_folder = converted_weights.converted_folder(embedded_model_path())
    assert converted_weights.is_complete(session_folder)
    monkeypatch.setenv("RAGSNAP_MODEL_CACHE", str(tmp_path))
    folder = converted_weights.converted_folder(embedded_model_path())
    shutil.copytree(session_folder, folder)

    sources: list[str] = []
    real = models._from_pretrained

    def recording(source, gguf_file, kwargs):
        sources.append(gguf_file or source)
        return real(source, gguf_file, kwargs)

    monkeypatch.setattr(models, "_from_pretrained", recording)
    reference = _last_logits(engine.loaded)

    fast = load_model("embedded", device="cpu", dtype="float32")
    assert sources == [str(folder)]
    assert fast.revision == engine.loaded.revision  # cache keys do not change
    torch.testing.assert_close(_last_logits(fast), reference, rtol=0, atol=0)

    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # a truncated file
    sources.clear()
    rebuilt = load_model("embedded", device="cpu", dtype="float32")
    assert sources == [str(folder), embedded_model_path().name]
    assert converted_weights.is_complete(folder) and weights.stat().st_size > 4096
    torch.testing.assert_close(_last_logits(rebuilt), reference, rtol=0, atol=0)
