"""The smaller limits of issue 40: one temperature limit and one seed range for the CLI,
the API and the engine; bad numbers refused by name before any model loads; the bytes a
request stores shown in its statistics even when they are written after the answer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ragsnap.cli import build_parser
from ragsnap.errors import ConfigError
from ragsnap.runtime.generation import MAX_TEMPERATURE, SEED_MAX, SEED_MIN, GenerationConfig

ASK = ["ask", "-q", "x", "--docs", "a.md"]


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--recompute-share", "2", "outside [0, 1]"),
        ("--recompute-share", "nan", "outside [0, 1]"),
        ("--recompute-share", "-0.5", "outside [0, 1]"),
        ("--recompute-share", "inf", "outside [0, 1]"),
        ("--recompute-share", "half", "not a number"),
        ("--temperature", "nan", "outside [0, 2]"),
        ("--temperature", "2.5", "outside [0, 2]"),
        ("--top-p", "0", "outside (0, 1]"),
        ("--seed", str(SEED_MAX + 1), "not a signed 64-bit integer"),
    ],
)
def test_bad_numbers_are_one_line_naming_the_flag(capsys, flag, value, said):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*ASK, f"{flag}={value}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and said in err and "Traceback" not in err


def test_the_edges_are_accepted_everywhere():
    from ragsnap.api.schemas import AnswerRequest, ChatCompletionRequest

    edges = ["--temperature", str(MAX_TEMPERATURE), "--seed", str(SEED_MIN)]
    args = build_parser().parse_args([*ASK, *edges, "--recompute-share", "1"])
    assert (args.temperature, args.seed, args.recompute_share) == (MAX_TEMPERATURE, SEED_MIN, 1.0)
    GenerationConfig(temperature=MAX_TEMPERATURE, seed=SEED_MAX)
    with pytest.raises(ConfigError, match="seed"):
        GenerationConfig(seed=SEED_MAX + 1)
    for model in (AnswerRequest, ChatCompletionRequest):
        extra = (
            {"model": "ragsnap", "messages": [{"role": "user", "content": "q"}]}
            if model is ChatCompletionRequest
            else {"question": "q", "documents": [{"text": "d"}]}
        )
        model(**extra, temperature=MAX_TEMPERATURE, seed=SEED_MAX)
        with pytest.raises(ValidationError, match="seed"):
            model(**extra, seed=SEED_MAX + 1)
        with pytest.raises(ValidationError, match="finite number"):
            model(**extra, temperature=float("nan"))
        with pytest.raises(ValidationError, match="less than or equal to 2"):
            model(**extra, temperature=2.5)


def test_a_miss_reports_the_bytes_it_stores_after_the_answer(tmp_path):
    from ragsnap.cache import open_store
    from ragsnap.compression import SnapKVPress
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.prompt.documents import Document
    from ragsnap.runtime.generation import GenerationConfig
    from tests.test_scheduler import Collector, run
    from tests.tiny_models import tiny_engine

    engine = RagSnapEngine(tiny_engine("llama").loaded, store=open_store(f"file://{tmp_path}"))
    docs = [Document(id="d", title="t3", text=" ".join(f"t{5 + i % 80}" for i in range(120)))]
    options = AnswerOptions(SnapKVPress(budget=24, window=8), GenerationConfig(max_new_tokens=3))
    first, again = Collector("t4 t5", docs, options), Collector("t4 t5", docs, options)
    run(engine, [first])
    run(engine, [again])
    written = first.done.stats.cache_bytes_written
    assert first.done.stats.cache == "miss" and again.done.stats.cache == "hit"
    stored = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    # the compressed, the prefix and the document entries' tensors, counted before they
    # were written
    assert 0.5 * stored < written <= stored
    assert again.done.stats.cache_bytes_written == 0


def test_the_retriever_logs_nothing_below_the_applications_level(caplog):
    import logging

    from ragsnap.prompt.documents import Document
    from ragsnap.retrieval.bm25 import BM25Index

    caplog.set_level(logging.WARNING)
    docs = [Document(id="a", text="the moon pulls the tides"), Document(id="b", text="bees")]
    assert BM25Index(docs).search("tides")[0].document.id == "a"
    assert not [r for r in caplog.records if r.name.startswith("bm25s")]


def test_stop_strings_end_the_in_process_answer_as_they_end_the_servers():
    from ragsnap.compression import SnapKVPress
    from ragsnap.engine.engine import AnswerOptions
    from ragsnap.prompt.documents import Document
    from tests.tiny_models import tiny_engine

    engine = tiny_engine("llama")
    engine.runtime.stop_ids.clear()  # random weights: decode to the length limit
    docs = [Document(id="d", title="t3", text=" ".join(f"t{5 + i % 80}" for i in range(60)))]
    press = SnapKVPress(budget=24, window=8)
    free = engine.answer("t4 t5", docs, AnswerOptions(press, GenerationConfig(max_new_tokens=12)))
    words = free.answer.split()
    stop = words[4]
    cut = engine.answer(
        "t4 t5", docs, AnswerOptions(press, GenerationConfig(max_new_tokens=12, stop=(stop,)))
    )
    assert cut.answer == free.answer[: free.answer.index(stop)]
    assert cut.stats.stop_sequence == stop and cut.stats.finish_reason == "stop"
    assert cut.stats.new_tokens < free.stats.new_tokens  # generation stopped, not just the text
    args = build_parser().parse_args([*ASK, "--stop", stop, "--stop", "\n\n"])
    from ragsnap.cli.options import generation_from_args
    from ragsnap.engine.options import config_from_args

    assert generation_from_args(args, config_from_args(args)).stop == (stop, "\n\n")
