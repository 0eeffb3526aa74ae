"""`ragsnap eval` end to end on the embedded model: a small BioASQ-format set and a small
needle set, two presses, files written, numbers consistent, resume skipping done items."""

from __future__ import annotations

import json
import re

import pytest

from ragsnap.compression import make_press
from ragsnap.eval.evaluate import EvalRequest, evaluate
from ragsnap.eval.fidelity import compare, fidelities, full_reference
from ragsnap.eval.niah import build_needles
from ragsnap.eval.report import fmt
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig

pytestmark = pytest.mark.model

PUBMED = "http://www.ncbi.nlm.nih.gov/pubmed/"
FACTS = [
    ("Honeybees communicate the location of flowers with a waggle dance.", "waggle dance"),
    ("Penicillin was discovered by Alexander Fleming in 1928.", "Alexander Fleming"),
    ("The Rosetta Stone was found near the town of Rashid in 1799.", "Rashid"),
    ("Tides are caused mainly by the gravity of the Moon.", "the Moon"),
]
FILLER = (
    "The committee met again on Tuesday to discuss the budget for the coming year, and "
    "after a long debate it agreed to postpone the decision until more figures were known. "
)


def write_bioasq(path):
    questions = []
    for i, (fact, answer) in enumerate(FACTS):
        snippets = [
            {"text": fact, "document": f"{PUBMED}{1000 + i}"},
            {"text": FILLER * 2, "document": f"{PUBMED}{2000 + i}"},
        ]
        questions.append(
            {
                "id": f"q{i}",
                "type": "factoid",
                "body": f"What does this say about fact {i}?",
                "documents": [f"{PUBMED}{1000 + i}"],
                "snippets": snippets,
                "exact_answer": [answer],
                "ideal_answer": [fact],
            }
        )
    questions[0]["body"] = "How do honeybees communicate the location of flowers?"
    questions[1].update(
        type="yesno", body="Was penicillin discovered by Alexander Fleming?", exact_answer="yes"
    )
    questions.append({"id": "broken", "type": "factoid", "body": "", "snippets": []})
    path.write_text(json.dumps({"questions": questions}))
    return path


def write_haystack(folder):
    folder.mkdir()
    sentences = [
        f"Essay sentence number {i} talks about gardens, rivers and old bridges."
        for i in range(120)
    ]
    (folder / "one.txt").write_text(" ".join(sentences[:60]))
    (folder / "two.txt").write_text(" ".join(sentences[60:]))
    return folder


def run_rows(report: str) -> dict[tuple[str, str], list[str]]:
    """Rows of the first table of report.md keyed by (press, budget)."""
    table = report.split("## Metrics")[1].split("##")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[(cells[0], cells[1])] = cells
    return rows


def check_consistency(out, expected_items):
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {"runs"}
    runs = metrics["runs"]
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == expected_items * len(runs)
    report = (out / "report.md").read_text()
    rows = run_rows(report)
    header = report.split("## Metrics")[1].splitlines()[2]
    columns = [c.strip() for c in header.strip("|").split("|")]
    for run in runs:
        expected = {"press", "budget", "n", "metrics", "ci", "retention", "timings"}
        for key, (low, high) in run["ci"].items():  # bootstrap 95% interval of the mean
            assert low - 1e-6 <= run["metrics"][key] <= high + 1e-6
        if run["press"] not in ("full", "snapkv"):  # paired with snapkv at its budget
            expected.add("versus")
            assert run["versus"]["n"] == expected_items
            assert (
                f"| {run['press']} | {run['budget']} | {expected_items} |"
                in (report.split("## Against snapkv at the same budget")[1])
            )
        assert set(run) == expected
        mine = [r for r in records if r["press"] == run["press"] and r["budget"] == run["budget"]]
        assert run["n"] == len(mine) == expected_items
        for record in mine:  # the report's citation columns score the served attribution
            scores = record["scores"]
            assert scores["citation_precision"] == scores["cite_combined_precision"]
            assert scores["citation_recall"] == scores["cite_combined_recall"]
        for key in ("accuracy", "agreement", "kl", "gold_kept_share"):
            values = [r["scores"][key] for r in mine if r["scores"].get(key) is not None]
            assert run["metrics"][key] == pytest.approx(sum(values) / len(values), abs=1e-6)
        row = rows[(run["press"], "all" if run["budget"] is None else str(run["budget"]))]
        assert row[2] == str(run["n"])
        for label, key in (("accuracy", "accuracy"), ("agreement", "agreement"), ("KL", "kl")):
            assert row[columns.index(label)] == fmt(run["metrics"][key])
    return runs, records


def test_eval_bioasq_and_needles_end_to_end(engine, tmp_path):
    data = write_bioasq(tmp_path / "golden.json")
    out = tmp_path / "bioasq-out"
    request = EvalRequest(
        out=out,
        data=data,
        format="bioasq",
        presses=["snapkv", "streamingllm"],
        budgets=[64, 128],
        context_tokens=300,
        max_new_tokens=12,
        progress=False,
    )
    result = evaluate(engine.runtime, request)
    assert result.evaluated == 4 and result.malformed == 1
    for name in (
        "metrics.json",
        "predictions.jsonl",
        "report.md",
        "score_vs_budget.png",
        "malformed.json",
    ):
        assert (out / name).stat().st_size > 0
    runs, records = check_consistency(out, 4)
    assert [(r["press"], r["budget"]) for r in runs] == [
        ("full", None),
        ("snapkv", 64),
        ("snapkv", 128),
        ("streamingllm", 64),
        ("streamingllm", 128),
    ]
    full = runs[0]["metrics"]
    assert full["agreement"] == 1.0 and full["kl"] == 0.0 and full["gold_kept_share"] == 1.0
    assert all(r["prompt_tokens"] > 128 for r in records)  # every press really compressed
    assert runs[1]["metrics"]["kept_tokens"] == 64 and runs[1]["metrics"]["kv_kept_share"] < 0.5
    assert "malformed items skipped: 1" in (out / "report.md").read_text()
    yesno = [r for r in records if r["type"] == "yesno"]
    assert yesno and "yesno_macro_f1" in runs[0]["metrics"]

    # resume: nothing left to do; then an interrupted item (its lines gone, a torn line) reruns
    again = evaluate(engine.runtime, request)
    assert again.evaluated == 0 and again.resumed == 4
    lines = (out / "predictions.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["item_id"] != "q3"]
    (out / "predictions.jsonl").write_text("\n".join(kept) + "\n" + '{"item_id": "q3", "pre')
    resumed = evaluate(engine.runtime, request)
    assert resumed.evaluated == 1 and resumed.resumed == 3
    check_consistency(out, 4)


def test_eval_needles_end_to_end(engine, tmp_path):
    haystack = write_haystack(tmp_path / "hay")
    out = tmp_path / "niah-out"
    request = EvalRequest(
        out=out,
        format="niah",
        haystack=haystack,
        lengths=[400],
        depths=[0, 100],
        samples=1,
        presses=["snapkv", "streamingllm"],
        budgets=[64],
        progress=False,
    )
    result = evaluate(engine.runtime, request)
    assert result.evaluated == 2
    runs, records = check_consistency(out, 2)
    assert (out / "needle_heatmap_snapkv.png").stat().st_size > 0
    full = runs[0]["metrics"]
    assert full["needle_kept_share"] == 1.0 and "needle_accuracy_length400" in full
    for r in records:
        assert 360 <= r["prompt_tokens"] <= 400
        assert 0.0 <= r["scores"]["needle_partial"] <= 1.0
        digits = re.findall(r"\d+", r["answer"])
        assert r["scores"]["needle_accuracy"] == float(r["gold_answers"][0] in digits)
    # streamingllm keeps the start and the end: a needle at depth 0 is in its sinks' reach only
    # by chance, but the needle-kept share it reports must match its positions
    assert "Needle accuracy by prompt length" in (out / "report.md").read_text()


def test_needle_builder_places_the_needle_at_the_depth(engine, tmp_path):
    haystack = write_haystack(tmp_path / "hay")
    items = build_needles(
        haystack, engine.tokenizer, lengths=[300], depths=[0, 50, 100], seed=3
    ).items
    assert [i.metadata["depth"] for i in items] == [0, 50, 100]
    positions = []
    for item in items:
        value = item.answers[0]
        assert len(value) == 7 and value.isdigit()
        holder = next(d for d in item.documents if d.id == item.gold_doc_ids[0])
        start, end = item.metadata["value_span"]
        assert holder.text[start:end] == value
        text = " ".join(d.text for d in item.documents)
        positions.append(text.index(value) / len(text))
        assert item.answer_prefix.startswith("The special magic number for " + item.metadata["key"])
    assert positions[0] < 0.1 and 0.35 < positions[1] < 0.65 and positions[2] > 0.9


def test_batched_decode_and_teacher_forcing_match_one_by_one(engine):
    docs = [Document(id="d", title="Bees", text=FACTS[0][0] + " " + FILLER * 3)]
    generation = GenerationConfig(max_new_tokens=6)
    layout = engine.build_prompt("How do honeybees communicate?", docs, generation)
    presses = [
        make_press("full"),
        make_press("snapkv", budget=48),
        make_press("streamingllm", budget=48),
        make_press("ragsnap", budget=48),  # a bias and layers of different lengths
    ]
    results = engine.runtime.prefill_many(layout.input_ids, presses)
    full_tokens = engine.runtime.generate(results[0], generation)
    reference = full_reference(engine.runtime, results[0], full_tokens)
    assert compare(reference.log_probs, reference)["kl"] == 0.0
    one_by_one = [fidelities(engine.runtime, [r], reference)[0] for r in results[1:]]
    batched = fidelities(engine.runtime, results[1:], reference)
    for row, single in zip(batched, one_by_one, strict=True):
        assert abs(row["kl"] - single["kl"]) < 1e-4
    assert all(row["kl"] > 0.0 for row in batched)
    batch = engine.runtime.decode_batch()
    rows = [batch.add(i, r, generation) for i, r in enumerate(results[1:])]
    for _ in batch.run():
        pass
    assert [r.tokens for r in rows] == [engine.runtime.generate(r, generation) for r in results[1:]]
