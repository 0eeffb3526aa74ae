"""A request body read as its JSON Schema reads it.

pydantic's lax mode takes ``true`` for the number 1, ``1`` for true and ``"5"`` for 5; the
schema it publishes refuses each, so a client reading the schema (or a fuzzer) would see a
server accept what its schema calls invalid. :class:`JsonBody` refuses them too.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ValidationInfo, field_validator


def json_kinds(annotation: Any) -> frozenset[str]:
    """The JSON kinds (``null``, ``bool``, ``int``, ``float``, ``str``, ``list``,
    ``dict``) a field of type ``annotation`` holds; empty: any."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return json_kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [json_kinds(arg) for arg in typing.get_args(annotation)]
        return frozenset() if not all(kinds) else frozenset().union(*kinds)
    if origin is Literal:
        return frozenset().union(*(json_kinds(type(v)) for v in typing.get_args(annotation)))
    simple = {type(None): "null", bool: "bool", str: "str", int: "int", float: "float"}
    if annotation in simple:
        # JSON Schema's integer includes 2.0, its number 2
        return frozenset({"int", "float"} if annotation in (int, float) else {simple[annotation]})
    if origin in (list, tuple) or annotation in (list, tuple):
        return frozenset({"list"})
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return frozenset({"dict"})
    return frozenset()


def _kind_of(value: Any) -> str:
    for kind, types_ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if isinstance(value, types_):
            return kind
    return "list" if isinstance(value, list) else "dict" if isinstance(value, dict) else "null"


class JsonBody(BaseModel):
    """A request body read as its JSON Schema reads it: pydantic's lax mode would take
    ``true`` for 1, ``1`` for true and ``"5"`` for 5, which the schema refuses."""

    @field_validator("*", mode="before")
    @classmethod
    def _json_kind(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        kinds = json_kinds(cls.model_fields[info.field_name].annotation)
        if kinds and _kind_of(value) not in kinds:
            wanted = sorted({_WORDS[kind] for kind in kinds})
            raise ValueError(f"must be {' or '.join(wanted)}, not {_WORDS[_kind_of(value)]}")
        return value


_WORDS = {
    "null": "null",
    "bool": "true or false",
    "int": "a number",
    "float": "a number",
    "str": "a string",
    "list": "an array",
    "dict": "an object",
}
