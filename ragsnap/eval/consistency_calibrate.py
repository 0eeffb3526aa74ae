"""Choose how the verdict holds to its evidence (issue 53) on held-out rows.

Reads the rows ``ragsnap.eval.grounding_eval --skip 50 --rows FILE`` writes and replays
the engine's verdict on them (:func:`replay`: the named gate, the profile's logistic
rule, then :func:`ragsnap.citations.verdict.consistent`) under each choice of

- which of the answer's terms no document holds refuse it (``answer_missing`` per term
  kind, :func:`ragsnap.citations.named.missing_terms`): none, names (numbers, dates,
  names), names and sentence openers, those and the question's words;
- what must be supported: nothing more (``off``), some sentence (``any``), the key
  sentence (``key``), a rescue taking plain words only or (``_doc``) any claim;
- the lift a plain paraphrase needs to be rescued (``rescue_lift``);
- whether the answer's documents must be about the question's subject (``relation``):
  no (``off``), the key sentence's cited documents must hold one of the question's
  numbers and names when it has any (``key_docs``, the row's ``ent_docs``), or any cited
  document must (``cited_docs``, ``ent_all``), or the key sentence's quotes must make
  the question at least this much likelier to the model (``qlift:X``, the row's
  ``question_lift``: the model's judgement that they are about what was asked; no key
  sentence quoted, no judgement), or (session 29, ``link``, ``link+qlift:X``) the
  documents holding the key sentence's names must be linked to the question's subject
  (the row's ``linked``; from ``--documents`` for rows recorded before it);

with the profile's weights and its bias refitted for both floors
(:func:`ragsnap.eval.grounding_calibrate.best_bias`). Positives are right answers to
answerable items, negatives answers to unanswerable ones, as in ``grounding_calibrate``.

``python -m ragsnap.eval.consistency_calibrate ROWS.json [ROWS.json ...]
--profile PROFILE.json [--out PROFILE.json --ship TERMS,SUPPORT,RESCUE]`` prints the
rates of every choice; ``--out`` writes the profile with the shipped choice.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ragsnap.citations.claims import claims
from ragsnap.citations.lift import LiftRule, SupportFeatures, key_sentence
from ragsnap.citations.named import begins_word, document_words, garbled, unfinished_at
from ragsnap.citations.relevance import unlinked
from ragsnap.citations.sentences import split_sentences
from ragsnap.eval.grounding_calibrate import best_bias
from ragsnap.prompt.documents import Document

TERM_CHOICES: dict[str, tuple[str, ...]] = {
    "none": (),
    "name": ("name",),
    "name_opening": ("name", "opening"),
    "name_opening_asked": ("name", "opening", "asked"),
}
# what must be supported; "_doc": the rescue takes any claim a document holds, not only
# plain words (``LiftRule.rescue_plain`` off)
SUPPORT_CHOICES = ("off", "any", "key", "any_doc", "key_doc")
RESCUE_CHOICES = (-math.inf, -0.25, 0.0, 0.1, 0.2, 0.3, 0.5, math.inf)
RELATION_CHOICES = {"off": None, "key_docs": "ent_docs", "cited_docs": "ent_all"}
RELATION_CHOICES |= {
    f"qlift:{x}": "question_lift" for x in (-0.5, -0.4, -0.3, -0.2, -0.1, 0.0, 0.1)
}
# (session 29) the answer's names must be linked to the question's subject by the prompt's
# documents (the row's ``linked``), alone or with a floor on the question's lift
RELATION_CHOICES |= {"link": "linked"}
RELATION_CHOICES |= {
    f"link+qlift:{x}": "linked+question_lift" for x in (-0.5, -0.4, -0.3, -0.2, -0.1, 0.0)
}


def labelled_rows(
    paths: Sequence[Path], documents: dict[str, Any] | None = None
) -> list[tuple[dict[str, Any], int]]:
    """(row, 1 for a right answerable answer / 0 for an unanswerable one) per row with a
    lexical score (answerable answers that are wrong are left out); rows recorded
    without ``linked`` get it from ``documents`` (``ragsnap.eval.item_documents``)."""
    out = []
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        for row in data["answerable"] + data["unanswerable"]:
            if "linked" not in row and documents and row["id"] in documents:
                row["linked"] = link(row, documents[row["id"]]["docs"])
        sets = [(r, 1) for r in data["answerable"] if r["correct"]]
        sets += [(r, 0) for r in data["unanswerable"]]
        out += [(r, y) for r, y in sets if r["lexical_score"] is not None]
    return out


def link(row: dict[str, Any], docs: Sequence[dict[str, str]]) -> bool | None:
    """The row's ``linked`` (:func:`ragsnap.citations.relevance.unlinked`, negated) from
    every document of its prompt."""
    answer = row["model_answer"]
    key = key_sentence(answer, row["question"])
    if key is None:
        return None
    prompt = [Document(id=d["id"], title=d["title"], text=d["text"]) for d in docs]
    apart = unlinked(row["question"], key.text, prompt)
    return None if apart is None else not apart


def features(row: dict[str, Any]) -> SupportFeatures:
    """The rule's features of a row (as ``grounding_calibrate.labelled`` reads them)."""
    kind = row.get("kind", 1.0)
    return SupportFeatures(
        row["lexical_score"],
        1.0 if row["key_supported"] else 0.0,
        row["lift"],
        1.0 if row.get("plain", True) else 0.0,
        float(row.get("coverage", 1.0)),
        row.get("question_lift"),
        1.0 if kind in (None, True) else float(kind),
        float(row.get("named", 1.0)),
    )


def refused(
    row: dict[str, Any], terms: Sequence[str], support: str, rescue: float, relation: str = "off"
) -> bool:
    """Whether the consistency gates refuse ``row`` whatever the rule's bias: a term of
    ``terms`` no document holds, documents about something else (``relation``), or
    (``support``) no supported sentence / an unsupported key sentence that is no plain
    paraphrase with a lift of at least ``rescue``."""
    missing = row.get("answer_missing", {})
    asked = {w.strip(".,;:!?\"'()[]").lower() for w in row.get("question", "").split()}
    openers = [w for w in missing.get("opening", []) if w.lower() not in asked]
    fresh = {"name": fresh_names(row) if missing.get("name") else [], "opening": openers}
    if any(fresh.get(kind, missing.get(kind)) for kind in terms):
        return True
    field = RELATION_CHOICES[relation]
    if field is not None and field.startswith("linked"):
        if row.get("linked") is False:
            return True
        field = field.removeprefix("linked").removeprefix("+") or None
    if field == "question_lift":
        lift = row.get("question_lift")
        if lift is not None and lift < float(relation.split(":")[1]):
            return True
    elif field is not None and row.get(field, 1.0) == 0.0:
        return True
    unbacked = (support != "off" and not row["lexical_score"]) or (
        support.startswith("key") and not row["key_supported"]
    )
    if not unbacked:
        return False
    lift = row["lift"]
    plain = support.endswith("_doc") or row.get("plain", True)
    return not (row["has_key"] and plain and lift is not None and lift >= rescue)


def fresh_names(row: dict[str, Any]) -> list[str]:
    """The row's missing names the engine now lets pass, for rows recorded before those
    rules: the question's own, garbled from a word of its cited documents, the unfinished
    last word of a cut answer (the other documents are not recorded, so this may keep a
    name another document holds)."""
    asked = {w.strip(".,;:!?\"'()[]").lower() for w in row.get("question", "").split()}
    names = [w for w in row["answer_missing"]["name"] if w.lower() not in asked]
    if "documents" not in row:  # recorded with the checks themselves
        return names
    docs = [Document(id=k, title=d["title"], text=d["text"]) for k, d in row["documents"].items()]
    vocabulary = document_words(docs)
    answer = row.get("model_answer", "").rstrip()
    last = answer.split()[-1].strip(".,;:!?\"'()[]") if unfinished_at(answer) <= len(answer) else ""
    return [
        w
        for w in names
        if not garbled(w, vocabulary) and not (w == last and begins_word(w, vocabulary))
    ]


def replay(rule: LiftRule, row: dict[str, Any], *choice: Any) -> bool:
    """The engine's verdict on ``row`` (True: grounded) under the ``choice`` given
    (:func:`refused`'s arguments after the row)."""
    f = features(row)
    if rule.gated(f.named) or refused(row, *choice):
        return False
    return rule.probability(f) >= 0.5


def rates(rule: LiftRule, data: Sequence[tuple[dict[str, Any], int]], *choice: Any) -> dict:
    """Right answers grounded and unanswerable ones not grounded under ``choice``."""
    pos = [replay(rule, r, *choice) for r, y in data if y == 1]
    neg = [not replay(rule, r, *choice) for r, y in data if y == 0]
    return {
        "right_grounded": round(sum(pos) / max(len(pos), 1), 4),
        "unanswerable_not_grounded": round(sum(neg) / max(len(neg), 1), 4),
    }


def rebias(
    rule: LiftRule,
    data: Sequence[tuple[dict[str, Any], int]],
    choice: tuple[Any, ...],
    right_grounded: float,
    unanswerable: float,
) -> LiftRule:
    """``rule`` with the bias that meets both floors best once the gates of ``choice``
    refuse what they refuse (those rows count as not grounded)."""
    base = replace(rule, bias=0.0)
    z = [
        None if base.gated(features(r).named) or refused(r, *choice) else base.logit(features(r))
        for r, _ in data
    ]
    pairs = [(features(r), y) for r, y in data]
    return replace(rule, bias=best_bias(z, pairs, right_grounded, unanswerable))


def contradictions(paths: Sequence[Path]) -> dict[str, int]:
    """Over every recorded row with the engine's verdict (``grounded``,
    ``unsupported_sentences``): how many are grounded while every sentence of theirs that
    asserts something is listed unsupported (the issue's invariant: none)."""
    rows = checked = bad = 0
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        for row in data["answerable"] + data["unanswerable"]:
            rows += 1
            if "unsupported_sentences" not in row:
                continue
            checked += 1
            spoken = row["model_answer"]
            spans = {(s.start, s.end) for s in split_sentences(spoken) if claims(s.text)}
            listed = {tuple(span) for span in row["unsupported_sentences"]}
            bad += bool(row["grounded"] and spans and spans <= listed)
    return {"rows": rows, "checked": checked, "grounded_with_every_sentence_unsupported": bad}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--profile", type=Path, required=True, help="the profile to start from")
    parser.add_argument("--right-grounded", type=float, default=0.9)
    parser.add_argument("--unanswerable", type=float, default=0.9)
    parser.add_argument("--ship", help="TERMS,SUPPORT,RESCUE,RELATION (name_opening,any,0,off)")
    parser.add_argument("--out", type=Path, help="write the profile with --ship here")
    parser.add_argument("--keep-bias", action="store_true", help="ship the profile's bias")
    parser.add_argument(
        "--documents",
        type=Path,
        action="append",
        default=[],
        help="every prompt's documents (ragsnap.eval.item_documents), for rows without 'linked'",
    )
    args = parser.parse_args(argv)
    profile = json.loads(args.profile.read_text(encoding="utf-8"))
    rule = LiftRule(**profile["rule"])
    documents: dict[str, Any] = {}
    for path in args.documents:
        documents |= json.loads(path.read_text(encoding="utf-8"))
    data = labelled_rows(args.rows, documents)
    report: dict[str, Any] = {
        "n_positive": sum(y for _, y in data),
        "n_negative": sum(1 - y for _, y in data),
        "shipped_profile": rates(rule, data, (), "off", math.inf),
        "engine_verdict": contradictions(args.rows),
        "choices": [],
    }
    grid = [
        (terms, support, rescue, relation)
        for terms in TERM_CHOICES
        for support in SUPPORT_CHOICES
        for rescue in (RESCUE_CHOICES if support != "off" else (math.inf,))
        for relation in RELATION_CHOICES
    ]
    floors = (args.right_grounded, args.unanswerable)
    for terms, support, rescue, relation in grid:
        choice = (TERM_CHOICES[terms], support, rescue, relation)
        fitted = rebias(rule, data, choice, *floors)
        report["choices"].append(
            {
                "terms": terms,
                "support": support,
                "rescue_lift": rescue,
                "relation": relation,
                "profile_bias": rates(rule, data, *choice),
                "bias": round(fitted.bias, 4),
                "refit_bias": rates(fitted, data, *choice),
            }
        )
    print(json.dumps(report, indent=1))
    if args.out and args.ship:
        terms, support, rescue, relation = args.ship.split(",")
        choice = (TERM_CHOICES[terms], support, float(rescue), relation)
        fitted = rule if args.keep_bias else rebias(rule, data, choice, *floors)
        floor = float(relation.split(":")[1]) if "qlift:" in relation else None
        fitted = replace(
            fitted,
            question_floor=floor,
            rescue_lift=float(rescue),
            rescue_plain=not support.endswith("_doc"),
            require_key=support.startswith("key"),
            link_check=relation.startswith("link"),
        )
        profile["rule"] = {
            k: (round(v, 6) if isinstance(v, float) else v) for k, v in vars(fitted).items()
        }
        profile["consistency"] = {
            "shipped": args.ship,
            "answer_terms": list(TERM_CHOICES[terms]),
            "support": support,
            "relation": relation,
            "calibrated_on": [p.name for p in args.rows],
            "held_out": rates(fitted, data, *choice),
            "held_out_per_file": {
                p.name: rates(fitted, labelled_rows([p], documents), *choice) for p in args.rows
            },
        }
        args.out.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
