"""``ragsnap bench peer`` without vLLM: the workload's prompts, the figures, and a whole run
against a real in-process ragsnap server and a stub peer that speaks the streaming
``/v1/completions`` protocol over HTTP."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ragsnap.cli import main
from ragsnap.cli.bench.peer_clients import Outcome
from ragsnap.cli.bench.peer_stats import agreement, ratios, summarize_run, token_f1
from ragsnap.cli.bench.peer_workload import build_workload
from ragsnap.eval.items import EvalItem
from ragsnap.prompt.assembly import assemble_prompt
from ragsnap.prompt.documents import Document

PEER_ANSWER = ["Paris", " is", " the", " capital", "."]


def hotpot_records(count: int) -> list[dict]:
    """MIRAGE-layout HotpotQA records: two gold paragraphs and a distractor each."""
    return [
        {
            "_id": f"q{i}",
            "question": f"Which city hosts landmark {i}?",
            "answer": "Paris",
            "title_a": f"Landmark {i}",
            "para_a": [f"Landmark {i} stands in Paris. ", "It is old. " * 8],
            "title_b": f"City {i}",
            "para_b": [f"City {i} is a capital. ", "It has rivers. " * 8],
            "distractors": [[f"Other {i}", ["Nothing to see here. " * 6], 0.1]],
        }
        for i in range(count)
    ]


def items(count: int) -> list[EvalItem]:
    out = []
    for r in hotpot_records(count):
        docs = [
            Document(id=r["title_a"], title=r["title_a"], text="".join(r["para_a"])),
            Document(id=r["title_b"], title=r["title_b"], text="".join(r["para_b"])),
        ]
        out.append(
            EvalItem(r["_id"], r["question"], docs, answers=["Paris"], gold_doc_ids=[r["title_a"]])
        )
    return out


def test_workload_sends_ragsnaps_own_prompt_and_keeps_levels_apart(tiny) -> None:
    tokenizer = tiny.tokenizer
    pool = items(8)
    workload = build_workload(
        pool, tokenizer, levels=[1, 2], prompts=2, context_tokens=120, max_prompt_tokens=4000
    )
    assert set(workload) == {1, 2}
    for level in workload.values():
        for cold, new in zip(level["cold"], level["new_question"], strict=True):
            layout = assemble_prompt(
                tokenizer, cold.question, list(cold.documents), max_prompt_tokens=4000
            )
            assert list(cold.prompt_ids) == layout.input_ids  # token for token what ragsnap builds
            assert len(cold.documents) > 2  # padded with other items' documents toward 120 tokens
            # a new question over the same ordered documents: the document prefix is shared
            assert new.documents == cold.documents and new.question != cold.question
            prefix = layout.prefix_len
            assert new.prompt_ids[:prefix] == cold.prompt_ids[:prefix]
            assert new.prompt_ids[prefix:] != cold.prompt_ids[prefix:]
        assert level["repeated"] == level["cold"]
    first = {d.id for r in workload[1]["cold"] for d in r.documents[:2]}
    second = {d.id for r in workload[2]["cold"] for d in r.documents[:2]}
    assert not first & second  # each level's cold requests are cold
    with pytest.raises(ValueError, match="items needed"):
        build_workload(
            pool[:3], tokenizer, levels=[1, 2], prompts=2, context_tokens=0, max_prompt_tokens=4000
        )


def test_figures_agreement_and_ratios() -> None:
    ours = [
        Outcome(
            "a",
            ok=True,
            ttft_s=0.5,
            last_token_s=1.5,
            total_s=1.9,  # the citations after the last token are no decode time
            new_tokens=11,
            prompt_tokens=9,
            text="The answer is Paris [1].",
        ),
        Outcome(
            "b",
            ok=True,
            ttft_s=1.0,
            last_token_s=2.0,
            total_s=2.0,
            new_tokens=3,
            prompt_tokens=9,
            text="Rome",
        ),
        Outcome("c", error="HTTP 500: boom"),
    ]
    theirs = [
        Outcome(
            "a",
            ok=True,
            ttft_s=0.2,
            total_s=1.2,
            new_tokens=11,
            prompt_tokens=9,
            text="answer is paris",
        ),
        Outcome("b", ok=True, ttft_s=0.4, total_s=0.9, new_tokens=3, prompt_tokens=9, text="Milan"),
        Outcome("c", ok=True, ttft_s=0.4, total_s=0.9, new_tokens=3, prompt_tokens=9, text="x"),
    ]
    run = summarize_run(ours, wall_s=4.0)
    assert run["answered"] == 2 and run["answers_per_s"] == 0.5
    assert run["tokens_per_s"] == 3.5 and run["ttft_s"] == {"p50": 0.5, "p95": 1.0}
    assert run["decode_tokens_per_s_p50"] == 6.0  # median of 10/1.0 and 2/1.0
    assert run["errors"] == ["HTTP 500: boom"]
    assert token_f1("The answer is Paris [1].", "answer is paris") == 1.0
    assert token_f1("Rome", "Milan") == 0.0
    agreed = agreement(ours, theirs)
    assert agreed == {"pairs": 2, "exact_match": 0.5, "token_f1": 0.5, "same_prompt_tokens": True}
    peer = summarize_run(theirs, wall_s=2.0)
    assert ratios(run, peer)["answers_per_s"] == round(0.5 / 1.5, 3)


def test_cli_refuses_bad_levels_and_scenarios(tiny, tmp_path, capsys) -> None:
    data = tmp_path / "hotpot.json"
    data.write_text(json.dumps(hotpot_records(2)))
    assert main(["bench", "peer", "--data", str(data), "--concurrency", "two"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench", "peer", "--data", str(data), "--scenarios", "warm"]) == 2
    assert "--scenarios" in capsys.readouterr().err


def stub_peer_app(seen: list[list[int]]):
    """A peer that streams a fixed answer for any token-id prompt, OpenAI's way."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        assert body["stream"] and body["temperature"] == 0.0 and body["stop_token_ids"]
        seen.append(body["prompt"])

        def chunks():
            for piece in PEER_ANSWER[: body["max_tokens"]]:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': piece}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(PEER_ANSWER)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_peer_run_against_ragsnap_and_a_stub_peer(tiny, tmp_path: Path, capsys) -> None:
    from ragsnap.api.app import create_app
    from ragsnap.api.local_server import running_server
    from ragsnap.api.settings import Settings
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine

    data = tmp_path / "hotpot.json"
    data.write_text(json.dumps(hotpot_records(6)))
    seen: list[list[int]] = []
    engine = RagSnapEngine(tiny.loaded, store=open_store(f"file://{tmp_path / 'kv'}"))
    settings = Settings(max_batch=2, max_queue=8)
    with (
        running_server(create_app(settings, engine=engine)) as ours,
        running_server(stub_peer_app(seen)) as peer,
    ):
        args = ["bench", "peer", "--data", str(data), "--ragsnap-url", ours, "--vllm-url", peer]
        args += ["--concurrency", "1,2", "--prompts", "2", "--context-tokens", "80"]
        args += ["--max-new-tokens", "4", "--budget", "32"]
        assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["runs"]) == {"c1", "c2"}
    assert report["setup"]["vllm"]["prefix_caching"] is True
    # the peer computes in the dtype ragsnap computes in here, unless told otherwise
    assert report["setup"]["vllm"]["dtype"] == report["setup"]["ragsnap"]["dtype"]
    for level in report["runs"].values():
        assert set(level) == {"cold", "repeated", "new_question"}
        for entry in level.values():
            for server in ("ragsnap", "vllm"):
                assert entry[server]["answered"] == 2 and entry[server]["answers_per_s"] > 0
            assert entry["agreement"]["pairs"] == 2
            assert (
                entry["agreement"]["same_prompt_tokens"] is True
            )  # both prefilled the same prompt
            assert entry["ratio"]["answers_per_s"] > 0
            assert entry["vllm"]["new_tokens"] == 2 * len(PEER_ANSWER)
            assert entry["ragsnap"]["server_s_p50"]["total_s"] > 0  # where ragsnap's time went
        assert level["cold"]["ragsnap"]["cache"] == {"miss": 2}
        assert level["repeated"]["ragsnap"]["cache"] == {"hit": 2}
        assert level["new_question"]["ragsnap"]["cache"] == {"prefix-hit": 2}
    # the warm-up, then 2 levels x 3 scenarios x 2 prompts, all as token ids
    assert len(seen) == 1 + 2 * 3 * 2 and all(isinstance(t, int) for t in seen[1])


def test_export_gives_vllm_a_plain_llama_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ragsnap.cli.bench.peer_servers import export_hf_folder
    from ragsnap.runtime.loading import converted_weights
    from tests.tiny_models import tiny_model, tiny_tokenizer

    model = tiny_model("llama", tie_word_embeddings=True)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    model.config.rope_parameters = {"rope_theta": 12345.0, "rope_type": "default"}
    source = tmp_path / "converted"
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert converted_weights.save_converted(model, tiny_tokenizer(), gguf, source)
    assert "model.embed_tokens.weight" not in load_file(str(source / "model.safetensors"))
    target = export_hf_folder(source, tmp_path / "hf")
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["rope_theta"] == 12345.0
    weights = load_file(str(target / "model.safetensors"))
    # the tied embedding under both names, as a Hugging Face loader finds it
    assert weights["model.embed_tokens.weight"].equal(model.model.embed_tokens.weight)
    assert weights["lm_head.weight"].equal(weights["model.embed_tokens.weight"])
    assert (target / "tokenizer.json").is_file()


def test_subprocess_server_waits_for_health_and_stops_its_group(tmp_path: Path) -> None:
    import sys

    from ragsnap.cli.bench.peer_servers import free_port, subprocess_server
    from ragsnap.errors import ConfigError

    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with subprocess_server(
        argv, {}, f"http://127.0.0.1:{port}/", tmp_path / "ok.log", 30
    ) as process:
        assert process.poll() is None
    assert process.poll() is not None  # stopped when the block ended
    failing = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(ConfigError, match="no model here"):
        with subprocess_server(failing, {}, "http://127.0.0.1:9/", tmp_path / "bad.log", 30):
            pass


def test_new_questions_ask_about_a_gold_document_by_its_title_or_first_words() -> None:
    from ragsnap.cli.bench.peer_workload import topic

    docs = [
        Document(id="1", title="Distractor", text="Nothing."),
        Document(id="2", title="Eiffel Tower", text="A tower."),
        Document(
            id="3",
            title="34022131",
            text="Variants upstream of the gene change its expression a lot.",
        ),
    ]
    assert topic(EvalItem("a", "q?", docs, gold_doc_ids=["2", "3"]), docs) == "Eiffel Tower"
    # a PubMed id is no topic: the document's first words are
    numbered = EvalItem("b", "q?", docs, gold_doc_ids=["3"])
    assert topic(numbered, docs) == "Variants upstream of the gene change"
    assert topic(EvalItem("c", "q?", docs), docs) == "Distractor"


def test_vllm_is_started_in_the_dtype_it_is_given() -> None:
    from ragsnap.cli.bench.peer_servers import vllm_argv

    argv = vllm_argv("python", "model", 8001, 8, "float32", ["--enforce-eager"])
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[-1] == "--enforce-eager"


def test_ragsnap_serve_gets_the_prefill_threads_it_is_given(tmp_path: Path) -> None:
    from ragsnap.cli import build_parser
    from ragsnap.cli.bench.peer_servers import ragsnap_argv
    from ragsnap.cli.serve import settings_from_args

    def settings(prefill_threads):
        argv = ragsnap_argv(8002, tmp_path, 8, "float32", 1, prefill_threads)
        assert argv[1:3] == ["-m", "ragsnap"]
        return settings_from_args(build_parser().parse_args(argv[3:]))

    assert settings(2).prefill_threads == 2
    assert settings(None).prefill_threads is None  # the server's default: every core


def test_vllm_computes_on_every_core_unless_told() -> None:
    import os

    from ragsnap.cli.bench.peer import vllm_binding

    assert vllm_binding("all") == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert vllm_binding("auto") == "auto" and vllm_binding("0-1") == "0-1"


def test_vllm_does_not_inherit_this_benchs_thread_settings(monkeypatch) -> None:
    from ragsnap.cli.bench.peer_servers import vllm_env

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what `ragsnap --threads 1` sets for itself
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    env = vllm_env("0,1", 2)
    assert "OMP_NUM_THREADS" not in env and "MKL_NUM_THREADS" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_each_timed_run_waits_for_ragsnaps_background_writes() -> None:
    from fastapi.responses import PlainTextResponse

    from ragsnap.api.local_server import running_server
    from ragsnap.cli.bench.peer import settle

    polls: list[int] = []
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        polls.append(1)
        pending = max(0, 3 - len(polls))  # two writes left, then one, then none
        return PlainTextResponse(
            "# HELP ragsnap_worker_busy x\nragsnap_worker_busy 0.0\n"
            f"# HELP ragsnap_store_writes_pending x\nragsnap_store_writes_pending {pending}.0\n"
        )

    with running_server(app) as url:
        settle(url, timeout_s=30)
        assert len(polls) == 3


def test_each_timed_run_waits_until_the_servers_stop_computing() -> None:
    """A process group that computes for a while, then idles: the wait ends only after it
    stopped (and at once for a group that is idle already)."""
    import subprocess
    import sys

    from ragsnap.cli.bench.peer_servers import group_cpu_ticks, wait_quiet

    busy = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass\ntime.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", busy], start_new_session=True)
    try:
        time.sleep(0.3)
        assert process.pid in group_cpu_ticks(process.pid)
        started = time.monotonic()
        waited = wait_quiet([process.pid], window_s=0.25, timeout_s=30)
        assert 1.0 < waited and time.monotonic() - started >= 1.0
        assert wait_quiet([process.pid], window_s=0.25, timeout_s=30) < 0.5
    finally:
        process.kill()
        process.wait()


def test_capacity_sends_a_fresh_document_set_per_request_in_flight(tiny) -> None:
    """``capacity`` at concurrency c gets max(prompts, c) cold requests of its own;
    ``long_answer`` gets ``prompts``; no document set is shared between scenarios or levels."""
    from functools import partial

    from ragsnap.cli.bench.peer import parse_scenarios

    build = partial(
        build_workload,
        tokenizer=tiny.tokenizer,
        prompts=2,
        context_tokens=0,
        max_prompt_tokens=4000,
    )
    workload = build(items(12), levels=[1, 3], scenarios=["capacity", "long_answer"])
    assert {k: {s: len(r) for s, r in v.items()} for k, v in workload.items()} == {
        1: {"capacity": 2, "long_answer": 2},
        3: {"capacity": 3, "long_answer": 2},
    }
    gold = [r.documents[0].id for v in workload.values() for runs in v.values() for r in runs]
    assert len(gold) == len(set(gold)) == 9
    with pytest.raises(ValueError, match="10 items needed"):
        build(items(9), levels=[1, 4], scenarios=["cold", "repeated", "capacity"])
    # cold is added only where a scenario reuses it
    assert parse_scenarios("capacity,long_answer") == ["capacity", "long_answer"]
    assert parse_scenarios("new_question") == ["cold", "new_question"]


def test_peak_memory_of_a_process_group_sees_what_it_allocates() -> None:
    import subprocess
    import sys

    from ragsnap.cli.bench.peer_servers import PeakMemory, group_memory_bytes

    grow = "import time\ntime.sleep(0.5)\nx = bytearray(200 * 2**20)\ntime.sleep(1.0)\ndel x\ntime.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", grow], start_new_session=True)
    try:
        time.sleep(0.2)
        before = group_memory_bytes(process.pid)
        with PeakMemory(process.pid, interval_s=0.05) as memory:
            time.sleep(2.0)
        after = group_memory_bytes(process.pid)
    finally:
        process.kill()
        process.wait()
    assert before < 100 * 2**20  # an interpreter, not yet the buffer
    assert memory.peak >= before + 190 * 2**20  # the 200 MiB buffer while it lived
    assert after < memory.peak - 150 * 2**20  # freed again: the peak is not the last sample


def test_kv_memory_reaches_ragsnap_serve_and_its_queue_holds_a_capacity_run(tmp_path) -> None:
    from ragsnap.cli import build_parser
    from ragsnap.cli.bench.peer_servers import ragsnap_argv
    from ragsnap.cli.serve import settings_from_args

    argv = ragsnap_argv(8002, tmp_path, 64, "float32", 1, None, "auto", 1.0, 64)
    settings = settings_from_args(build_parser().parse_args(argv[3:]))
    assert settings.kv_memory_gib == 1.0 and settings.max_batch == 64
    assert settings.max_queue >= 64  # all of a capacity run waits rather than getting 429
    plain = settings_from_args(
        build_parser().parse_args(ragsnap_argv(8002, tmp_path, 8, "float32", 1)[3:])
    )
    assert plain.kv_memory_gib is None and plain.max_queue == 16


def test_capacity_and_long_answer_runs_against_ragsnap_and_a_stub_peer(
    tiny, tmp_path, capsys
) -> None:
    from ragsnap.api.app import create_app
    from ragsnap.api.local_server import running_server
    from ragsnap.api.settings import Settings
    from ragsnap.engine.engine import RagSnapEngine

    data = tmp_path / "hotpot.json"
    data.write_text(json.dumps(hotpot_records(8)))
    seen: list[list[int]] = []
    engine = RagSnapEngine(tiny.loaded)
    with (
        running_server(create_app(Settings(max_batch=2, max_queue=8), engine=engine)) as ours,
        running_server(stub_peer_app(seen)) as peer,
    ):
        args = ["bench", "peer", "--data", str(data), "--ragsnap-url", ours, "--vllm-url", peer]
        args += ["--concurrency", "3", "--prompts", "1", "--context-tokens", "40"]
        args += ["--max-new-tokens", "4", "--budget", "32", "--scenarios", "capacity,long_answer"]
        assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]["c3"]
    assert set(runs) == {"capacity", "long_answer"}
    assert runs["capacity"]["ragsnap"]["answered"] == runs["capacity"]["vllm"]["answered"] == 3
    assert runs["long_answer"]["ragsnap"]["answered"] == 1
    # servers given by URL: the bench did not start them, so it cannot see their memory
    assert runs["capacity"]["ragsnap"]["peak_memory_mib"] is None
    assert runs["capacity"]["ratio"]["peak_memory"] is None
    assert len(seen) == 1 + 3 + 1


def test_ragsnap_serve_admits_as_many_documents_as_the_workload_sends(monkeypatch) -> None:
    """Padded BioASQ prompts hold dozens of snippets: the bench's server takes them all
    instead of answering 413 (the default limit is 32)."""
    from ragsnap.api.settings import Settings
    from ragsnap.cli.bench.peer_servers import ragsnap_env

    monkeypatch.delenv("RAGSNAP_MAX_DOCUMENTS", raising=False)
    assert "RAGSNAP_MAX_DOCUMENTS" not in ragsnap_env(1)
    assert Settings().max_documents == 32
    monkeypatch.setenv("RAGSNAP_MAX_DOCUMENTS", ragsnap_env(1, 41)["RAGSNAP_MAX_DOCUMENTS"])
    assert Settings().max_documents == 41
