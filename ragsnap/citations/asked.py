"""Does the answer supply the kind of thing the question asks for (issue 43)?

A sentence its quote backs word for word may still answer nothing: with the answer's
documents gone, a model copies whatever sentence is left, or restates the question. Two
cheap, lexical signs, read from the question's form and the answer's quotes:

- the *asked kind* (:func:`asked_kind`): "when" and "what year" ask for a date, "how
  many" for a number, "who" and "where" (and "which actor", "what county", ...) for a
  name, other "what / which <noun>" questions for some thing; the answer's key sentence
  must supply one of that kind that its quotes back and the question does not already
  name (:func:`supplies`);
- *choices* ("Which director lived longer, X or Y?") and *pairs* ("Are X and Y both
  tennis players?"): the answer compares named things, so it must quote facts about
  every one of them, not about one alone: for each, a cited document about it (its
  title names it) or a quoted sentence whose subject it is (it opens the sentence)
  (:func:`options_about`); a sentence that merely mentions it in passing ("... the
  fifth album by the band Superdrag") is not a fact about it. A choice must also name
  one of its options.

:func:`answer_kind` combines them into the rule's ``kind`` feature (1.0: answers the kind
asked, 0.0: does not). A question whose form tells nothing (``open``: "how are ...
connected", "why") asks for some thing: any backed claim it does not name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ragsnap.citations.claims import Claim, claim_keys, claims
from ragsnap.citations.lift import key_sentence, sentence_quotes
from ragsnap.citations.model import Citation

KINDS = ("date", "number", "name", "thing", "choice", "pair", "yesno", "open")

_MONTHS = frozenset(
    """january february march april may june july august september october november
    december""".split()
)
_TIME_WORDS = frozenset({"century", "centuries", "decade", "decades"})
# nouns after "what / which" that ask for a date, a number or a name
_DATE_NOUNS = frozenset("year years date day month decade century era".split())
_NUMBER_NOUNS = frozenset(
    """number percentage percent size population amount age height length width depth
    capacity area distance weight total count score price cost""".split()
)
_NAME_NOUNS = frozenset(
    """person man woman actor actress director singer author writer player athlete
    president king queen emperor composer musician artist politician producer founder
    leader member character poet novelist painter scientist coach manager footballer
    rapper band group company team club city country state county region town village
    island river place location province capital university school college
    organization organisation network label station channel""".split()
)
_AUXILIARIES = frozenset(
    "are is was were do does did has have had can could will would should".split()
)
_WH = re.compile(r"\b(?:who|whom|whose|when|where|which|what|how)\b", re.IGNORECASE)
_WORDS = re.compile(r"[A-Za-z][\w-]*")
# ", X or Y?" / ", X or Y, introduced?": the options of a choice
_CHOICE = re.compile(r",\s*(?P<a>[^,?]+?)\s+or\s+(?P<b>[^,?]+?)\s*(?:,|\?|$)")
# "X or Y?" closing a question with no comma before it ("... a public or private database?")
_BARE_CHOICE = re.compile(r"\b(?P<a>[\w'-]+(?:\s+[\w'-]+)?)\s+or\s+(?P<b>[^,?]+?)\s*\??\s*$")
# "X and Y": two named things a question asks about together
_NAME_RUN = r"(?:[A-Z0-9][\w.'&-]*)(?:\s+(?:(?:of|the|de|van|von)\s+)?[A-Z0-9][\w.'&-]*)*"
_PAIR = re.compile(rf"(?P<a>{_NAME_RUN})\s+and\s+(?P<b>{_NAME_RUN})")
# what a question about a pair asks of both: "both", "in common", "the same"
_TOGETHER = re.compile(r"\b(?:both|in common|the same|same)\b", re.IGNORECASE)
_FILLERS = frozenset("is was are were does did do has had type kind sort of the a an".split())


@dataclass(frozen=True)
class Asked:
    """What a question asks for: its ``kind`` (of :data:`KINDS`), the ``options`` it
    compares or asks about together (a choice's, a pair's; else empty) and the ``noun``
    after "what / which" (or "")."""

    kind: str
    options: tuple[str, ...] = ()
    noun: str = ""


def _wh_match(question: str) -> re.Match[str] | None:
    """The question word that asks: the first when the question opens with it (after at
    most one word: "In which year ..."), else the last ("..., formerly known as what?")."""
    found = list(_WH.finditer(question))
    if not found:
        return None
    words_before = len(_WORDS.findall(question[: found[0].start()]))
    return found[0] if words_before <= 1 else found[-1]


def _options(match: re.Match[str]) -> tuple[str, ...]:
    def strip(text: str) -> str:
        return re.sub(r"^(?:the|a|an|both)\s+", "", text.strip(), flags=re.IGNORECASE)

    return tuple(strip(match.group(g)) for g in ("a", "b"))


def _wh_kind(word: str, following: Sequence[str]) -> tuple[str, str]:
    """The kind a question word asks for, and its noun (for "what / which <noun>")."""
    after = following[0] if following else ""
    if word == "how":
        many = ("many", "much", "long", "old", "tall", "far", "large", "big", "high", "often")
        return ("number", "") if after in many else ("open", "")
    if word == "when":
        return "date", ""
    if word in ("who", "whom", "whose", "where"):
        return "name", ""
    noun = next((w for w in following if w not in _FILLERS), "")
    if noun in _DATE_NOUNS:
        return "date", noun
    if noun in _NUMBER_NOUNS:
        return "number", noun
    if noun in _NAME_NOUNS or noun.removesuffix("s") in _NAME_NOUNS:
        return "name", noun
    return "thing", noun


def asked_kind(question: str) -> Asked:
    """The kind of answer ``question`` asks for, from its form alone."""
    text = question.strip()
    head, _, rest = text.partition(" ")
    choice = _CHOICE.search(text)
    pair = _PAIR.search(rest) if _TOGETHER.search(text) or head.lower() in _AUXILIARIES else None
    together = _options(pair) if pair is not None else ()
    if head.lower() in _AUXILIARIES:  # a yes-no question
        if choice is not None:
            return Asked("choice", _options(choice))
        if pair is not None:
            return Asked("pair", together)
        bare = _BARE_CHOICE.search(text)
        return Asked("choice", _options(bare)) if bare is not None else Asked("yesno")
    wh = _wh_match(text)
    if wh is None:
        bare = _BARE_CHOICE.search(text)
        return Asked("choice", _options(bare)) if bare is not None else Asked("open")
    following = [w.lower() for w in _WORDS.findall(text[wh.end() :])[:4]]
    kind, noun = _wh_kind(wh.group(0).lower(), following)
    if choice is not None:
        # "Which director lived longer, X or Y?" names an option; "Which year was the more
        # recent, X or Y, introduced?" asks for a date about the options
        return Asked("choice" if kind in ("name", "thing") else kind, _options(choice), noun)
    return Asked(kind, together, noun)


def is_date(claim: Claim) -> bool:
    """A year (1000-2099, or a decade such as "1970s"), a month or a century word."""
    if claim.kind == "number":
        key = claim.key.removeprefix("ord:")
        return bool(re.fullmatch(r"1\d{3}s?|20\d{2}s?", key))
    word = claim.text.lower()
    return word in _MONTHS or claim.key in _MONTHS or word in _TIME_WORDS


def is_name(claim: Claim) -> bool:
    """A named thing: a capitalized word (at a sentence's start too) or an acronym."""
    return claim.kind == "entity" or (claim.kind != "number" and claim.text[:1].isupper())


def of_kind(claim: Claim, kind: str) -> bool:
    """Whether ``claim`` is a thing of the asked ``kind``."""
    if kind == "date":
        return is_date(claim)
    if kind == "number":
        return claim.kind == "number"
    if kind == "name":
        return is_name(claim)
    return True


def supplies(
    kind: str, sentence: str, quotes: Iterable[str], question: str, strict: bool = False
) -> bool:
    """Whether ``sentence`` says something of ``kind`` that ``quotes`` back and
    ``question`` does not name (a ``thing``: any such claim); with ``strict``, also no
    number or name the question does not name that they do not back (an invented
    answer beside a backed one)."""
    backed = set().union(*(claim_keys(q) for q in quotes))
    asked = claim_keys(question)
    new = [c for c in claims(sentence) if c.key not in asked]
    if strict and any(c.kind in ("number", "entity") and c.key not in backed for c in new):
        return False
    return any(c.key in backed and of_kind(c, kind) for c in new)


def option_keys(option: str) -> set[str]:
    """The keys that name ``option``: its names' keys, else all its claims' keys (a
    single letter, as in "Honda H", names nothing by itself)."""
    said = [c for c in claims(" " + option) if len(c.key) > 1]  # a capital read as a name
    named = {c.key for c in said if is_name(c)}
    return named or {c.key for c in said}


def options_quoted(options: Sequence[str], quotes: Iterable[str]) -> bool:
    """Whether ``quotes`` hold at least half of every option's naming keys (facts
    about each compared thing, not about one alone)."""
    held = set().union(*(claim_keys(q) for q in quotes))
    for option in options:
        keys = option_keys(option)
        if keys and 2 * len(keys & held) < len(keys):
            return False
    return True


def _names_all(keys: set[str], text: str) -> bool:
    return bool(keys) and keys <= claim_keys(text)


def _opens_with(keys: set[str], sentence: str) -> bool:
    """Whether ``sentence`` opens with what ``keys`` name (they are among its first
    claims: its subject)."""
    head = {c.key for c in claims(" " + sentence)[: len(keys) + 1]}
    return bool(keys) and keys <= head


def options_about(options: Sequence[str], citations: Sequence[Citation]) -> bool:
    """Whether ``citations`` quote a fact about every option: a cited document whose
    title names it (all its naming keys), or a quoted sentence it opens."""
    for option in options:
        keys = option_keys(option)
        titled = any(_names_all(keys, c.title) for c in citations if c.quotes)
        opened = any(_opens_with(keys, q.text) for c in citations for q in c.quotes)
        if keys and not (titled or opened):
            return False
    return True


def all_quotes(citations: Sequence[Citation]) -> list[str]:
    """Every quote of ``citations`` and their documents' titles."""
    out: list[str] = []
    for citation in citations:
        out += [citation.title] if citation.title else []
        out += [q.text for q in citation.quotes]
    return out


def answer_kind(
    question: str, answer: str, citations: Sequence[Citation], strict: bool = False
) -> float:
    """1.0 when ``answer`` supplies the kind of thing ``question`` asks for, else 0.0:
    the citations must quote a fact about every option a choice or a pair names
    (:func:`options_about`); a choice's answer must
    name one of them; otherwise the key sentence must say something of the asked kind
    its quotes back (:func:`supplies`, ``strict`` there; an ``open`` question: any
    claim)."""
    asked = asked_kind(question)
    if asked.options and not options_about(asked.options, citations):
        return 0.0
    if asked.kind in ("pair", "yesno"):  # a yes or a no supplies nothing new
        return 1.0
    if asked.kind == "choice":
        said = claim_keys(answer)
        return 1.0 if any(option_keys(o) & said for o in asked.options) else 0.0
    key = key_sentence(answer, question)
    if key is None:
        return 0.0
    quotes = sentence_quotes(key, citations)
    return 1.0 if supplies(asked.kind, key.text, quotes, question, strict) else 0.0
