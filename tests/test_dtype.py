"""The compute dtype: ``auto`` picks bfloat16 where the hardware multiplies it, and a
bfloat16 model's cache entries are its own."""

from __future__ import annotations

import pytest
import torch

from ragsnap.cli import build_parser
from ragsnap.engine.options import config_from_args
from ragsnap.errors import ModelLoadError
from ragsnap.runtime.loading import models
from ragsnap.runtime.loading.models import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(models, "bf16_matrix_units", lambda: False)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype(None, CUDA) == torch.bfloat16
    monkeypatch.setattr(models, "bf16_matrix_units", lambda: True)
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    assert resolve_dtype("float32", CPU) == torch.float32  # asked for: always honoured


@pytest.mark.parametrize("bad", ["int8", "bool", "fp64x", "cuda"])
def test_an_unknown_dtype_names_itself(bad):
    with pytest.raises(ModelLoadError, match=bad):
        resolve_dtype(bad, CPU)


def test_every_model_command_takes_dtype(monkeypatch):
    monkeypatch.setenv("RAGSNAP_DTYPE", "bfloat16")
    for command in (["ask", "-q", "x", "--docs", "a.md"], ["bench", "batch"], ["serve"]):
        args = build_parser().parse_args([*command, "--dtype", "float32"])
        assert args.dtype == "float32"
    args = build_parser().parse_args(["ask", "-q", "x", "--docs", "a.md"])
    assert args.dtype is None and config_from_args(args).dtype == "bfloat16"  # the environment's
    assert config_from_args(build_parser().parse_args(["bench", "batch"])).dtype == "bfloat16"


@pytest.mark.model
def test_a_bfloat16_engine_answers_and_keeps_its_own_entries(engine, tmp_path):
    from ragsnap.cache import open_store
    from ragsnap.compression import make_press
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.prompt.documents import Document
    from ragsnap.runtime.generation import GenerationConfig
    from ragsnap.runtime.loading.cpu_linears import can_pack

    store = open_store(f"file://{tmp_path}")
    half = RagSnapEngine.load("embedded", device="cpu", dtype="bfloat16", store=store)
    assert next(half.loaded.model.parameters()).dtype == torch.bfloat16
    if can_pack():  # its CPU linears are oneDNN-packed, none left dense
        assert not any(type(m) is torch.nn.Linear for m in half.loaded.model.modules())
    docs = [Document(id="t", title="Tides", text="Tides are caused mostly by the Moon's gravity.")]
    options = AnswerOptions(
        press=make_press("snapkv", budget=48, window=8),
        generation=GenerationConfig(max_new_tokens=8),
    )
    first = half.answer("What causes tides?", docs, options)
    assert first.answer.strip() and first.stats.cache == "miss"
    assert half.answer("What causes tides?", docs, options).stats.cache == "hit"
    # the float32 engine on the same store computes its own entry
    full = RagSnapEngine(engine.loaded, store=store)
    assert full.answer("What causes tides?", docs, options).stats.cache == "miss"
