"""The model's yes/no judgement that an answer's key sentence answers the question, given
its quotes (issue 53, session 29: a relation check tried and dropped).

Per recorded row (``ragsnap.eval.grounding_eval --rows``): log P("Yes") - log P("No") for
the first answer token after a chat prompt holding the key sentence's quotes, the
question and the key sentence. Writes ``{row id: judgement}`` as JSON (None: no key
sentence or no quote).

``.venv/bin/python lab/scripts/yes_no_judgement.py ROWS.json [ROWS.json ...] --out OUT.json``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ragsnap.citations.lift import key_sentence, sentence_quotes
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.eval.grounding_features import citation_from_dict

PROMPT = (
    "Document:\n{quotes}\n\nQuestion: {question}\nProposed answer: {answer}\n\n"
    "According to the document, does the proposed answer answer the question? Reply Yes or No."
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    engine = RagSnapEngine.load(
        "embedded", device="cpu", dtype="float32", cache_url="none", threads=args.threads
    )
    tok = engine.tokenizer

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    yes, no = ids("Yes")[0], ids("No")[0]
    out: dict[str, float | None] = {}
    for path in args.rows:
        data = json.loads(path.read_text(encoding="utf-8"))
        for row in data["answerable"] + data["unanswerable"]:
            citations = [citation_from_dict(c) for c in row["citations"]]
            key = key_sentence(row["model_answer"], row["question"])
            quotes = sentence_quotes(key, citations) if key is not None else []
            if key is None or not quotes:
                out[row["id"]] = None
                continue
            text = PROMPT.format(
                quotes="\n".join(quotes), question=row["question"], answer=key.text
            )
            chat = [{"role": "user", "content": text}]
            prompt = ids(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
            with torch.no_grad():
                logits = engine.runtime.model(torch.tensor([prompt])).logits[0, -1].float()
            logp = torch.log_softmax(logits, -1)
            out[row["id"]] = float(logp[yes] - logp[no])
    args.out.write_text(json.dumps(out), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
