"""Token roles of structured documents (JSON, XML/HTML, Markdown tables, CSV).

Attention-mass selection on structured text keeps delimiters and keys and drops the values
an answer needs (delimiters draw about 40x the mass of values); role-conditioned presses
give each role its own share of the budget. :mod:`ragsnap.prompt.structure` tags prompts with these
codes, one per prompt position (``[L]`` ``torch.uint8``), and the engine hands them to
presses as ``LayerContext.roles``.
"""

from __future__ import annotations

from enum import IntEnum


class TokenRole(IntEnum):
    """What a prompt token is, as far as structure goes (prose and headers are ``OTHER``)."""

    OTHER = 0  # prose, document headers, the question and the template
    KEY = 1  # object keys, tag and attribute names, table and CSV header cells
    VALUE = 2  # strings, numbers and literals in value position, element text, body cells
    DELIM = 3  # braces, brackets, commas, colons, quotes, tag brackets, pipes
    WS = 4  # whitespace-only tokens between structural items
    INSTRUCTION = 5  # the prompt head: the system instruction (see KeepInstructionPress)


STRUCTURAL = (TokenRole.KEY, TokenRole.VALUE, TokenRole.DELIM)
