"""A verdict that never contradicts its evidence (issue 53): an answer none of whose
sentences its quotes support is not grounded unless the likelihood shows a paraphrase,
and an answer naming what no document mentions is not grounded and says which words.

Constructed cases and a tiny random model; no data file is read."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ragsnap.citations.lift import KeyEvidence, LiftRule, key_sentence, load_lift_rule
from ragsnap.citations.model import Citation, Quote, Span
from ragsnap.citations.named import answer_not_in_documents, missing_terms
from ragsnap.citations.options import CitationOptions
from ragsnap.citations.relevance import plain_missing, unlinked
from ragsnap.citations.sentences import Sentence, split_sentences
from ragsnap.citations.support import check_sentence
from ragsnap.citations.verdict import consistent, grounding, judge
from ragsnap.engine.events import DoneEvent
from ragsnap.prompt.documents import Document

EMBEDDED = "llama-L30-d576-h9-kv3-v49152"  # the embedded model's shipped profile
ROSETTA = Document(
    id="rosetta",
    title="Rosetta Stone",
    text="The Rosetta Stone was found in 1799 by French soldiers near Rashid. "
    "It has been on public display at the British Museum in London since 1802.",
)
ESSAY = Document(
    id="essay",
    title="How to start a startup",
    text="Most startups fail because they make something nobody wants. Founders "
    "should talk to users early and ship fast.",
)
SENTENCES = (
    "The telephone was invented by Alexander Graham Bell in 1876.",
    "Bell patented it in Boston.",
    "It changed how people talk across distances.",
    "Edison later improved the carbon microphone.",
    "Paris is the capital of France.",
)


def _done(answer: str, citations: list[Citation]) -> DoneEvent:
    return DoneEvent(answer=answer, citations=citations, stats=None)  # type: ignore[arg-type]


def _failed(answer: str, index: int, span: tuple[int, int]) -> Citation:
    """A citation cited for ``span`` whose quote backs none of its first claim."""
    text = answer[span[0] : span[1]]
    word = text.split()[0]
    return Citation(
        index=index,
        doc_id=str(index),
        title="",
        supported=False,
        spans=(span,),
        quotes=(Quote("Founders should ship fast.", 0, 26, 0.5),),
        unsupported=(Span(word, span[0], span[0] + len(word)),),
    )


weights = st.floats(-6.0, 6.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    picks=st.lists(st.sampled_from(SENTENCES), min_size=1, max_size=4),
    cited=st.lists(st.booleans(), min_size=4, max_size=4),
    rule=st.builds(
        LiftRule,
        lexical=weights,
        answer=weights,
        lift=weights,
        bias=weights,
        coverage=weights,
        kind=weights,
        clip=st.floats(0.5, 3.0),
        plain_only=st.booleans(),
        rescue_lift=st.floats(-1.0, 1.0),
        require_key=st.booleans(),
        question_floor=st.none() | st.floats(-1.0, 1.0),
        link_check=st.booleans(),
    ),
    asked=st.none() | st.floats(-3.0, 3.0),
    apart=st.none() | st.booleans(),
    lift=st.none() | st.floats(-3.0, 3.0),
    kind=st.sampled_from([0.0, 1.0]),
    coverage=st.floats(0.0, 1.0),
    abstain=st.booleans(),
)
def test_no_answer_whose_every_sentence_is_unsupported_is_grounded(
    picks, cited, rule, asked, apart, lift, kind, coverage, abstain
):
    answer = " ".join(picks)
    sentences = split_sentences(answer)
    # each sentence is cited by a failing citation, or by none: none is supported
    citations = [
        _failed(answer, i + 1, (s.start, s.end))
        for i, s in enumerate(sentences)
        if cited[i % len(cited)]
    ]
    key = key_sentence(answer, "Who invented the telephone?")
    plain = key is None or plain_missing(key, citations)
    evidence = KeyEvidence(key, lift, plain, coverage, asked, kind, unlinked=apart)
    options = CitationOptions(unsupported="abstain" if abstain else "flag")
    judged = judge(_done(answer, citations), options, evidence, rule)
    assert grounding(answer, citations).score == 0.0
    every = {(s.start, s.end) for s in sentences}
    listed = {tuple(span) for span in judged.unsupported_sentences}
    if listed >= every:
        assert judged.grounded is False and judged.grounded_score <= 0.5
        assert judged.answer == (options.abstain_text if abstain else answer)
    if judged.grounded:  # only a plain paraphrase the lift vouches for is ever rescued
        assert evidence.plain and lift is not None and lift >= rule.rescue_lift
        assert key is not None and [key.start, key.end] not in judged.unsupported_sentences
    # the lexical verdict alone never grounds it either
    assert judge(_done(answer, citations), options).grounded is False


def test_the_shipped_profile_no_longer_grounds_an_answer_no_quote_supports():
    rule = load_lift_rule(EMBEDDED)
    assert rule is not None
    answer = "The invention of the telephone is credited to Alexander Graham Bell in 1876."
    citations = [_failed(answer, 1, (0, len(answer)))]
    key = Sentence(answer, 0, len(answer))
    # the case: every feature but the share said yes (kind, coverage, a high
    # lift); the names are in no document
    invented = ("Graham", "Bell", "1876")
    evidence = KeyEvidence(key, 1.0, False, 1.0, kind=1.0, answer_not_in_documents=invented)
    judged = judge(_done(answer, citations), CitationOptions(), evidence, rule)
    assert judged.grounded is False and judged.grounded_score == 0.0
    assert judged.unsupported_sentences == [[0, len(answer)]]
    # with what it says in the documents, only a lift reaching rescue_lift grounds it
    verdict = grounding(answer, citations)
    assert verdict.score == 0.0
    for lift, grounded in (
        (rule.rescue_lift, True),
        (rule.rescue_lift - 0.01, False),
        (None, False),
    ):
        evidence = KeyEvidence(key, lift, False, 1.0, kind=1.0)
        out = consistent(replace(verdict, grounded=True, score=0.8), 0.0, evidence, rule)
        assert out.grounded is grounded and out.unsupported == (
            () if grounded else verdict.unsupported
        )
        assert grounded or out.score == 0.0
    # a rule that rescues plain words only keeps a missing name unsupported
    plain = replace(rule, rescue_plain=True)
    evidence = KeyEvidence(key, 1.0, False, 1.0, kind=1.0)
    assert not consistent(replace(verdict, grounded=True, score=0.8), 0.0, evidence, plain).grounded


def test_an_answer_naming_what_no_document_mentions_is_not_grounded_and_says_which_words():
    question = "Who invented the telephone?"
    answer = "The telephone was invented by Alexander Graham Bell in 1876."
    assert answer_not_in_documents(answer, [ESSAY], question) == [
        "Alexander",
        "Graham",
        "Bell",
        "1876",
    ]
    # an opening name counts; what a document holds (text or title) does not
    assert answer_not_in_documents("Paris is the capital.", [ESSAY]) == ["Paris"]
    assert answer_not_in_documents("Founders ship fast.", [ESSAY]) == []
    assert answer_not_in_documents("It was found in 1799.", [ROSETTA]) == []
    assert answer_not_in_documents(
        "FRENCH soldiers found it in 1,799 near Alexandria.", [ROSETTA]
    ) == ["Alexandria"]
    # plain words a paraphrase may choose are only measured, never gated
    found = missing_terms(answer, [ESSAY], question)
    assert found["asked"] == ["telephone", "invented"] and found["name"][-1] == "1876"
    # the verdict: whatever the rule says, not grounded (score 0.0), and the words listed
    quote = Quote(ESSAY.text, 0, len(ESSAY.text), 1.0)
    cited = [
        Citation(
            1, "essay", ESSAY.title, supported=True, spans=((0, len(answer)),), quotes=(quote,)
        )
    ]
    key = Sentence(answer, 0, len(answer))
    evidence = KeyEvidence(key, 2.0, answer_not_in_documents=("Bell", "1876"))
    always = LiftRule(0.0, 0.0, 0.0, 9.0, 1.0)
    options = CitationOptions(unsupported="abstain")
    judged = judge(_done(answer, cited), options, evidence, always)
    assert judged.grounded is False and judged.grounded_score == 0.0
    assert judged.answer_not_in_documents == ["Bell", "1876"]
    assert judged.answer == options.abstain_text and judged.model_answer == answer
    assert judged.verdict()["answer_not_in_documents"] == ["Bell", "1876"]
    # the same evidence without the missing words: the rule grounds it
    assert judge(_done(answer, cited), options, KeyEvidence(key, 2.0), always).grounded is True


def test_paraphrases_the_quotes_support_stay_grounded():
    rule = load_lift_rule(EMBEDDED)
    assert rule is not None
    question = "Where is the Rosetta Stone kept?"
    quote_text = ROSETTA.text.split(". ")[1]
    quote = Quote(quote_text, 0, len(quote_text), 0.9)
    paraphrases = (
        "The Rosetta Stone is kept at the British Museum in London.",
        "Since 1802 the Rosetta Stone has been displayed at London's British Museum.",
        "It is on public display in the British Museum, London.",
    )
    for answer in paraphrases:
        span = (0, len(answer))
        check = check_sentence(
            Sentence(answer, *span), [quote_text, ROSETTA.title], [ROSETTA.text], question
        )
        assert check.supported, answer
        cited = [
            Citation(1, "rosetta", ROSETTA.title, supported=True, spans=(span,), quotes=(quote,))
        ]
        assert answer_not_in_documents(answer, [ROSETTA], question) == []
        key = key_sentence(answer, question)
        evidence = KeyEvidence(key, 0.3, plain_missing(key, cited), 1.0, kind=1.0)
        judged = judge(_done(answer, cited), CitationOptions(), evidence, rule)
        assert judged.grounded is True and judged.unsupported_sentences == [], answer
    # a looser paraphrase the words alone do not back: the lift rescues it (plain words)
    answer = "The Stone can be seen by anyone who visits the British Museum."
    span = (0, len(answer))
    check = check_sentence(
        Sentence(answer, *span), [quote_text, ROSETTA.title], [ROSETTA.text], question
    )
    assert not check.supported and all(c.kind == "word" for c in check.missing)
    flagged = Citation(
        1,
        "rosetta",
        ROSETTA.title,
        supported=False,
        spans=(span,),
        quotes=(quote,),
        unsupported=tuple(Span(c.text, c.start, c.end) for c in check.missing),
    )
    key = key_sentence(answer, question)
    assert key is not None and plain_missing(key, [flagged])
    high = KeyEvidence(key, 0.6, True, 1.0, kind=1.0)
    judged = judge(_done(answer, [flagged]), CitationOptions(), high, rule)
    assert judged.grounded is True and judged.unsupported_sentences == []
    low = KeyEvidence(key, -0.5, True, 1.0, kind=1.0)
    judged = judge(_done(answer, [flagged]), CitationOptions(), low, rule)
    assert judged.grounded is False and judged.unsupported_sentences == [list(span)]


def test_every_route_reports_the_answer_s_missing_words(tmp_path, capsys, monkeypatch):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from ragsnap.cli import main
    from ragsnap.engine import citing
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.integrations.langchain import ChatRagSnap
    from ragsnap.integrations.langchain.rag import cited_answer
    from ragsnap.runtime.generation import GenerationConfig
    from tests.api_helpers import parse_sse
    from tests.local_client import LocalClient
    from tests.tiny_models import tiny_engine

    # the tiny model's words are random: the check itself is stubbed to name two words
    monkeypatch.setattr(citing, "answer_not_in_documents", lambda *a, **k: ["Bell", "1876"])
    engine = tiny_engine("llama", "sdpa", seed=4)
    question = "Who invented the telephone?"
    docs = [{"id": "essay", "title": ESSAY.title, "text": ESSAY.text}]
    options = AnswerOptions(generation=GenerationConfig(max_new_tokens=6))
    for rule in (None, LiftRule(0.0, 0.0, 0.0, 9.0, 1.0)):
        engine.citing.lift_rule = rule
        done = list(engine.stream(question, [ESSAY], options))[-1]
        assert isinstance(done, DoneEvent) and done.answer_not_in_documents == ["Bell", "1876"]
        assert done.grounded is not True
    chat = ChatRagSnap(engine=engine, max_new_tokens=6)
    reply = chat.invoke(question, documents=[ESSAY])
    assert reply.response_metadata["answer_not_in_documents"] == ["Bell", "1876"]
    assert cited_answer(reply)["answer_not_in_documents"] == ["Bell", "1876"]
    body = {"question": question, "documents": docs, "max_new_tokens": 6}
    openai = {
        "model": "ragsnap",
        "messages": [{"role": "user", "content": question}],
        "documents": docs,
        "max_tokens": 6,
    }
    with LocalClient(create_app(Settings(cache_url="none"), engine=engine)) as client:
        native = client.post("/v1/answer", json=body).json()
        again = {**body, "question": "Who made the first telephone?", "stream": True}
        streamed = client.post("/v1/answer", json=again).text
        chat_json = client.post("/v1/chat/completions", json=openai).json()
    assert native["answer_not_in_documents"] == ["Bell", "1876"] and native["grounded"] is not True
    done_event = [data for name, data in parse_sse(streamed.splitlines()) if name == "done"][-1]
    assert done_event["answer_not_in_documents"] == ["Bell", "1876"]
    assert chat_json["ragsnap"]["answer_not_in_documents"] == ["Bell", "1876"]
    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(lambda cls, *a, **k: engine))
    path = tmp_path / "essay.txt"
    path.write_text(ESSAY.text, encoding="utf-8")
    argv = ["ask", "-q", question, "--docs", str(path), "--max-new-tokens", "6", "--cache", "none"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["answer_not_in_documents"] == ["Bell", "1876"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert 'the answer names what no document mentions: "Bell", "1876"' in out


def test_quotes_that_do_not_make_the_question_likelier_do_not_ground_it(monkeypatch):
    from tests.test_likelihood_lift import counted_passes
    from tests.tiny_models import tiny_engine

    answer = "The Stone is in the British Museum."
    span = (0, len(answer))
    quote = Quote(ROSETTA.text, 0, len(ROSETTA.text), 1.0)
    cited = [Citation(1, "rosetta", ROSETTA.title, supported=True, spans=(span,), quotes=(quote,))]
    key = Sentence(answer, *span)
    floor = LiftRule(0.0, 0.0, 0.0, 9.0, 1.0, question_floor=-0.1)
    assert floor.asks_question
    for asked, grounded in ((-0.5, False), (-0.05, True), (None, True)):
        evidence = KeyEvidence(key, 0.5, question_lift=asked)
        judged = judge(_done(answer, cited), CitationOptions(), evidence, floor)
        assert judged.grounded is grounded, asked
    # the engine measures the question's lift whenever the answer may be grounded
    engine = tiny_engine("llama", seed=4)
    calls = counted_passes(engine, monkeypatch)
    engine.citing.lift_rule = LiftRule(0.0, 0.0, 0.0, 9.0, 1.0)
    found = engine.citing.key_evidence("Where is it?", answer, cited, [ROSETTA])
    assert calls == [] and found.question_lift == 0.0  # decided without a pass
    engine.citing.lift_rule = floor
    found = engine.citing.key_evidence("Where is it?", answer, cited, [ROSETTA])
    assert calls == [2] and found.question_lift is not None


def test_a_name_garbled_from_a_document_s_is_found_a_new_one_is_not():
    from ragsnap.citations.named import garbled

    vocabulary = {"pembrolizumab", "bym338", "parts", "1867", "edison"}
    assert garbled("Pembrol", vocabulary) and garbled("BIM338", vocabulary)
    # short words, other digits, years and other first letters are new content
    for word in ("Paris", "BIM339", "1876", "Madison", "Edisons2"):
        assert not garbled(word, vocabulary), word
    docs = [Document(id="k", text="KEYNOTE-522 tested pembrolizumab. Bimagrumab (BYM338).")]
    answer = "KEYNOTE-522 studied pembrolizumab (Pembrol). Bimagrumab is BIM338, not Avelumab."
    assert answer_not_in_documents(answer, docs) == ["Avelumab"]


def test_the_demo_s_invented_date_is_in_no_sample_document():
    from pathlib import Path

    samples = Path(__file__).parents[1] / "ragsnap" / "samples"
    docs = [Document(id=p.stem, title=p.stem, text=p.read_text()) for p in samples.glob("*.md")]
    assert docs
    answer = (
        "The Rosetta Stone is kept in the British Museum in London, where it was first "
        "discovered in 1829."
    )
    assert answer_not_in_documents(answer, docs, "Where is the Rosetta Stone kept?") == ["1829"]
    kept = "The Rosetta Stone is kept in the British Museum in London."
    assert answer_not_in_documents(kept, docs, "Where is the Rosetta Stone kept?") == []


def test_the_last_word_of_an_answer_cut_mid_sentence_is_judged_as_a_prefix():
    docs = [Document(id="q", text="Qinzhou has 684,360 people; Jingjiang 1,234,000 in 1975.")]
    cut = "Qinzhou has 684,360 people, Jingjiang more, counted in 197"
    assert answer_not_in_documents(cut, docs) == []
    assert answer_not_in_documents(cut + "4.", docs) == ["1974"]  # finished: judged whole
    assert answer_not_in_documents("Qinzhou is bigger than Paris", docs) == ["Paris"]


def test_the_cli_names_a_rescued_sentence_a_paraphrase(capsys):
    from ragsnap.cli.ask import print_summary
    from tests.tiny_models import tiny_engine

    done = tiny_engine("llama", seed=4).answer("Where is it?", [ROSETTA])
    answer = "It can be seen by anyone at the British Museum."
    span = (0, len(answer))
    quote = Quote(ROSETTA.text, 0, 10, 1.0)
    missing = (Span("seen", 10, 14),)
    cited = Citation(
        1,
        "rosetta",
        "Rosetta Stone",
        supported=False,
        spans=(span,),
        quotes=(quote,),
        unsupported=missing,
    )
    rescued = replace(
        done,
        answer=answer,
        citations=[cited],
        grounded=True,
        grounded_score=0.7,
        unsupported_sentences=[],
    )
    print_summary(rescued)
    out = capsys.readouterr().out
    assert "[1] Rosetta Stone PARAPHRASE (not in its quotes: seen)" in out
    assert "grounded: yes" in out and "not backed by its quotes" not in out
    refused = replace(
        rescued, grounded=False, grounded_score=0.0, unsupported_sentences=[list(span)]
    )
    print_summary(refused)
    out = capsys.readouterr().out
    assert "UNSUPPORTED (not in its quotes: seen)" in out and "grounded: no" in out


# a HotpotQA-like bridge: the question names its subject, the answer's name sits in
# another page that the subject's page names by title
OAKHAM = Document(
    id="oakham",
    title="Oakham Castle",
    text="Oakham Castle was built for Walchelin de Ferriers, captain of Richard I of England.",
)
RICHARD = Document(
    id="richard",
    title="Richard I of England",
    text="Richard I was King of England. His mother was Eleanor of Aquitaine.",
)
BEAUFRANCHET = Document(
    id="beaufranchet",
    title="Jacques Beaufranchet (soldier)",
    text="He left behind his wife, who was King Louis XV's mistress, Marie Louise Morphy.",
)
WALCHELIN = "Who is the mother of the king that Walchelin de Ferriers was principal captain to?"


def test_an_answer_s_names_must_be_linked_to_the_question_s_subject():
    """Issue 53, session 29: answers that do not answer. The answer's names are linked
    when a document naming the question's subject holds them, or names (or is named by)
    the document that does; a distractor's name is not; what cannot be checked is None."""
    right = "The king's mother was Eleanor of Aquitaine."
    copied = "The king's mother was Marie Louise Morphy, wife of Louis XV."
    prompt = [OAKHAM, RICHARD, BEAUFRANCHET]
    assert unlinked(WALCHELIN, right, prompt) is False  # by the title "Richard I of England"
    assert unlinked(WALCHELIN, copied, prompt) is True
    # the subject's own page holding the name links it
    assert unlinked(WALCHELIN, "He was captain to Richard I.", prompt) is False
    # the link is by the whole title (its qualifier dropped), read in either direction
    named_back = replace(BEAUFRANCHET, text=BEAUFRANCHET.text + " Compare Oakham Castle.")
    assert unlinked(WALCHELIN, copied, [OAKHAM, RICHARD, named_back]) is False
    # nothing to check: the question names nothing, the answer supplies no name, or no
    # document holds the answer's names (the answer gate's case) or the question's
    assert unlinked("who was the king's mother?", copied, prompt) is None
    assert unlinked(WALCHELIN, "It was the king's mother.", prompt) is None
    assert unlinked(WALCHELIN, "It was Berengaria of Navarre.", prompt) is None
    assert unlinked(WALCHELIN, copied, [BEAUFRANCHET]) is None


def test_an_unlinked_answer_is_not_grounded_and_skips_the_likelihood_pass(monkeypatch):
    from tests.test_likelihood_lift import counted_passes
    from tests.tiny_models import tiny_engine

    copied = "The king's mother was Marie Louise Morphy, wife of Louis XV."
    span = (0, len(copied))
    quote = Quote(BEAUFRANCHET.text, 0, len(BEAUFRANCHET.text), 1.0)
    cited = [
        Citation(
            3, "beaufranchet", BEAUFRANCHET.title, supported=True, spans=(span,), quotes=(quote,)
        )
    ]
    key = Sentence(copied, *span)
    rule = LiftRule(0.0, 0.0, 0.0, 9.0, 1.0, link_check=True)
    for apart, grounded in ((True, False), (False, True), (None, True)):
        evidence = KeyEvidence(key, 0.5, unlinked=apart)
        judged = judge(_done(copied, cited), CitationOptions(), evidence, rule)
        assert judged.grounded is grounded, apart
        judged = judge(
            _done(copied, cited), CitationOptions(), evidence, replace(rule, link_check=False)
        )
        assert judged.grounded is True
    assert (
        judge(
            _done(copied, cited),
            CitationOptions(unsupported="abstain"),
            KeyEvidence(key, 0.5, unlinked=True),
            rule,
        ).answer
        == CitationOptions().abstain_text
    )
    # the engine finds it over the prompt's documents and needs no likelihood pass then
    engine = tiny_engine("llama", seed=4)
    calls = counted_passes(engine, monkeypatch)
    engine.citing.lift_rule = replace(rule, question_floor=-0.1)
    found = engine.citing.key_evidence(WALCHELIN, copied, cited, [OAKHAM, RICHARD, BEAUFRANCHET])
    assert found.unlinked is True and calls == []
    # linked (the distractor names the subject's page): the floor's pass runs
    named_back = replace(BEAUFRANCHET, text=BEAUFRANCHET.text + " Compare Oakham Castle.")
    found = engine.citing.key_evidence(WALCHELIN, copied, cited, [OAKHAM, RICHARD, named_back])
    assert found.unlinked is False and calls == [2]


def test_the_shipped_profile_checks_the_link():
    rule = load_lift_rule(EMBEDDED)
    assert rule is not None and rule.link_check and rule.question_floor == -0.3
