"""What a sentence asserts: its numbers, dates, named entities and content words, each
with its character span and a normalized key (issue 43).

Normalization makes a paraphrase meet its source: case, thousands separators ("1,200" is
``1200``), scale words ("1.2 million" is ``1200000``), number words ("three" is ``3``),
units ("kilometres" is ``km``, "%" is ``percent``), month abbreviations and simple
inflections (plurals, ``-ed``, ``-ing``). Citation markers (``[2]``) assert nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ragsnap.citations.markers import MARKER
from ragsnap.citations.sentences import STOPWORDS

_TOKEN = re.compile(
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"(?:(?P<suf>st|nd|rd|th|s)(?![^\W\d_]))?"
    r"|(?P<pct>%)"
    r"|(?P<word>[^\W\d_]+)"
)
# verbs and words that link a claim rather than make one
_LIGHT = frozenset(
    """known called named became become becomes made make makes gave give gives given
    used use uses located include includes included including contain contains
    contained consist consists refer refers referred means mean meant also however
    therefore thus approximately about around roughly nearly almost just well many
    much several various based term because since while although though due despite
    within without via yet still even type kind form part component product example
    member sort variety people person manner way degree degrees""".split()
)
_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero _ two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
    if w != "_"  # "one" is a pronoun as often as a number: a stopword
}
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70"})
_NUMBER_WORDS.update({"eighty": "80", "ninety": "90", "hundred": "100", "dozen": "12"})
_ORDINALS = {
    "first": "1", "second": "2", "third": "3", "fourth": "4", "fifth": "5",
    "sixth": "6", "seventh": "7", "eighth": "8", "ninth": "9", "tenth": "10",
}  # fmt: skip
_SCALES = {"thousand": 1_000, "million": 1_000_000, "billion": 10**9, "trillion": 10**12}
_UNITS = {
    "percent": "percent", "per": "per", "kilometre": "km", "kilometres": "km",
    "kilometer": "km", "kilometers": "km", "metre": "m", "metres": "m", "meter": "m",
    "meters": "m", "centimetre": "cm", "centimetres": "cm", "centimeter": "cm",
    "centimeters": "cm", "millimetre": "mm", "millimetres": "mm", "millimeter": "mm",
    "millimeters": "mm", "kilogram": "kg", "kilograms": "kg", "kilo": "kg", "kilos": "kg",
    "gram": "g", "grams": "g", "mile": "mi", "miles": "mi", "pound": "lb", "pounds": "lb",
    "lbs": "lb", "foot": "ft", "feet": "ft", "hour": "h", "hours": "h", "hr": "h",
    "hrs": "h", "minute": "min", "minutes": "min", "mins": "min", "second": "sec",
    "seconds": "sec", "secs": "sec", "celsius": "c", "fahrenheit": "f", "litre": "l",
    "litres": "l", "liter": "l", "liters": "l", "year": "year", "years": "year",
    "yr": "year", "yrs": "year", "jan": "january", "feb": "february", "mar": "march",
    "apr": "april", "jun": "june", "jul": "july", "aug": "august", "sep": "september",
    "sept": "september", "oct": "october", "nov": "november", "dec": "december",
}  # fmt: skip
# the abbreviations themselves ("330 m", "100 °C") meet their spelled-out forms
_UNITS.update({u: u for u in ("km", "m", "cm", "mm", "kg", "g", "mi", "lb", "ft", "h", "min")})
_UNITS.update({"sec": "sec", "c": "c", "f": "f", "l": "l"})
# irregular verb forms a paraphrase swaps for the regular ones ("won" / "winning")
_IRREGULAR = {
    "won": "win", "wrote": "writ", "written": "writ", "began": "begin", "begun": "begin",
    "born": "bear", "bore": "bear", "built": "build", "led": "lead", "held": "hold",
    "sold": "sell", "taught": "teach", "bought": "buy", "grew": "grow",
    "grown": "grow", "ran": "run", "took": "tak", "taken": "tak", "went": "go", "gone": "go",
}  # fmt: skip


@dataclass(frozen=True)
class Claim:
    """``text == source[start:end]``; ``kind`` is ``number``, ``entity`` (a capitalized
    word inside a sentence, or an acronym) or ``word``; ``key`` its normalized form."""

    text: str
    start: int
    end: int
    key: str
    kind: str


def stem(word: str) -> str:
    """A light stemmer: plural, ``-ed``, ``-ing``, final ``-e``/``-y`` and doubled
    consonants, so "founded"/"founding"/"founds" and "countries"/"country" meet."""
    w = word.lower()
    if w in _IRREGULAR:
        return _IRREGULAR[w]
    if len(w) <= 3:
        return w
    if w.endswith("ment") and len(w) > 7:  # "treatment" / "treated"
        w = w[:-4]
    if w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith("es") and (w[-3] in "sxz" or w[-4:-2] in ("ch", "sh")):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    if w.endswith("ing") and len(w) > 5:
        w = w[:-3]
    elif w.endswith("ed") and len(w) > 4:
        w = w[:-2]
    if len(w) >= 4 and w[-1] == w[-2] and w[-1] not in "aeiouls":
        w = w[:-1]
    if len(w) > 3 and w[-1] in "ey":
        w = w[:-1] + ("i" if w[-1] == "y" else "")
    return w


def _number_key(digits: str, scale: int = 1) -> str:
    value = float(digits.replace(",", "")) * scale
    return str(int(value)) if value.is_integer() else f"{value:g}"


def claims(text: str, offset: int = 0) -> list[Claim]:
    """What ``text`` asserts, in order; spans are shifted by ``offset``."""
    masked = MARKER.sub(lambda m: " " * len(m.group(0)), text)
    tokens = list(_TOKEN.finditer(masked))
    out: list[Claim] = []
    first_word = True
    for i, m in enumerate(tokens):
        start, end = m.start() + offset, m.end() + offset
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if m.group("num"):
            suffix = (m.group("suf") or "").lower()
            scale = nxt.group("word").lower() if nxt is not None and nxt.group("word") else ""
            if suffix in ("st", "nd", "rd", "th"):
                key = "ord:" + _number_key(m.group("num"))
            elif suffix == "s":
                key = _number_key(m.group("num")) + "s"
            else:
                key = _number_key(m.group("num"), _SCALES.get(scale, 1))
            out.append(Claim(m.group(0), start, end, key, "number"))
            first_word = False
            continue
        if m.group("pct"):
            out.append(Claim("%", start, end, "percent", "word"))
            continue
        word = m.group("word")
        lower = word.lower()
        at_start, first_word = first_word, False
        gap = masked[out[-1].end - offset : m.start()] if out else ""
        if lower in _SCALES and out and out[-1].kind == "number" and gap.isspace():
            continue  # folded into the number before it
        if lower in _NUMBER_WORDS:
            out.append(Claim(word, start, end, _NUMBER_WORDS[lower], "number"))
        elif lower in _ORDINALS:
            out.append(Claim(word, start, end, "ord:" + _ORDINALS[lower], "number"))
        elif lower in _UNITS:
            out.append(Claim(word, start, end, _UNITS[lower], "word"))
        elif lower in STOPWORDS or lower in _LIGHT or len(word) < 2:
            continue
        else:
            entity = (word[0].isupper() and not at_start) or sum(c.isupper() for c in word) > 1
            out.append(Claim(word, start, end, stem(word), "entity" if entity else "word"))
    return out


def claim_keys(text: str) -> set[str]:
    """The keys of every claim ``text`` makes (the side a claim is looked up in)."""
    return {c.key for c in claims(text)}
