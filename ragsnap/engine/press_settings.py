"""Every press setting, written once: its type, bounds, default and meaning.

:class:`PressSettings` is part of :class:`~ragsnap.engine.config.EngineConfig` (so each
field is a ``RAGSNAP_*`` variable, a generated flag and a row of docs/configuration.md);
:class:`PressOverrides` is what one request may change, the same fields with the same
bounds, each unset by default (then the configuration decides). The API's ``compression``
object, LangChain's ``compression=`` and the CLI's press flags are these two classes;
:func:`ragsnap.engine.request_options.answer_options` turns them into a press.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from ragsnap.compression import DEFAULT_PRESS, PRESSES
from ragsnap.compression.base import DEFAULT_BUDGET, DEFAULT_KERNEL, DEFAULT_WINDOW
from ragsnap.engine.json_body import JsonBody


def _known_press(value: str) -> str:
    if value not in PRESSES:
        raise ValueError(f"unknown press {value!r} (choose from: {', '.join(PRESSES)})")
    return value


# a press name; the schema lists the names, so a client (and schemathesis) sees them
_PRESS_NAMES = WithJsonSchema({"type": "string", "enum": list(PRESSES)})
PressName = Annotated[str, AfterValidator(_known_press), _PRESS_NAMES]
# in a request the name is checked when the press is built (make_press: a 422 naming
# compression.press), after the body's own fields, so a body missing one names that first
RequestPressName = Annotated[str, _PRESS_NAMES]


class PressSettings(BaseModel):
    """The press a request gets, and its options. ``budget`` and ``ratio`` are one choice:
    giving ``ratio`` unsets the default budget; giving both is an error."""

    default_press: PressName = Field(
        default=DEFAULT_PRESS,
        description="press of the requests that name none; `ragsnap` drafts no answer tokens "
        "before compressing (sooner first token, lower fidelity)",
    )
    window: int = Field(
        default=DEFAULT_WINDOW,
        ge=1,
        le=4096,
        description="observation window: last prompt tokens that vote, always kept",
    )
    budget: int | None = Field(
        default=DEFAULT_BUDGET,
        ge=1,
        le=1_000_000,
        description="tokens kept per KV head, window included (configured: at least the window)",
    )
    ratio: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="share of the prompt kept per KV head, in (0, 1] (instead of budget)",
    )
    kernel: int = Field(
        default=DEFAULT_KERNEL,
        ge=1,
        le=257,
        json_schema_extra={"not": {"type": "integer", "multipleOf": 2}},  # odd
        description="pooling kernel of the votes along positions, odd (SnapKV-based presses)",
    )
    pooling: Literal["max", "avg"] = Field(
        default="max", description="pooling of the votes along positions"
    )
    layer_profile: str = Field(
        default="auto",
        min_length=1,
        description="ragsnap / layerbudget layer budgets: 'auto' (packaged profile), "
        "'uniform', or a profile JSON from 'ragsnap calibrate' (not a request field)",
    )
    keep_instruction: bool = Field(
        default=False, description="always keep the system instruction's tokens, whatever the press"
    )
    lookup: bool = Field(
        default=False,
        description="on structured documents, keep first the record the question names "
        "(its key, attribute or cell matched against the question's words)",
    )
    lookahead: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="draft the first N answer tokens on the full cache and let them vote with "
        "the window (unset: the press's own; the default press drafts 8; 0 turns it off)",
    )
    propagate_layer: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="query-aware prefill: layers 1..S see every prompt token, later ones only "
        "the share the window chose (unset: the model's calibrated s; giving it turns "
        "propagation on)",
    )
    propagate_share: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="query-aware prefill: share of the prompt's tokens past layer S, in (0, 1] "
        "(unset: the model's calibrated p; giving it turns propagation on)",
    )
    full_prefill: bool = Field(
        default=False,
        description="force the full prefill path: presses that propagate (query-aware "
        "prefill) run without it",
    )
    decode_slack: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="decode-phase SnapKV: select again once a layer holds this many entries "
        "more than its prompt kept (unset: off)",
    )
    decode_window: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="decode-phase SnapKV: last answer tokens that vote, at most the slack "
        "(unset: 16, or the slack when smaller)",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_size(cls, data: Any) -> Any:
        # ratio given, budget not: the ratio replaces the default budget
        if isinstance(data, dict) and data.get("ratio") is not None:
            if data.get("budget") is not None:
                raise ValueError("give budget or ratio, not both")
            data = {**data, "budget": None}
        return data

    @field_validator("kernel")
    @classmethod
    def _odd_kernel(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"must be odd, got {value}")
        return value

    @field_validator("budget")
    @classmethod
    def _budget_holds_the_window(cls, value: int | None, info: ValidationInfo) -> int | None:
        window = info.data.get("window")  # declared before the budget: validated first
        if value is not None and window is not None and value < window:
            raise ValueError(f"budget ({value}) must be at least the window ({window})")
        return value

    @field_validator("decode_window")
    @classmethod
    def _decode_window_fits(cls, value: int | None, info: ValidationInfo) -> int | None:
        slack = info.data.get("decode_slack")  # declared before the window: validated first
        if value is not None and slack is not None and value > slack:
            raise ValueError(f"decode window ({value}) must be at most the slack ({slack})")
        return value


# the request's name of a setting that the configuration calls otherwise
REQUEST_NAMES = {"default_press": "press"}
# settings a request may not change: a path on the server's disk
CONFIG_ONLY = frozenset({"layer_profile"})


def bounds(info: FieldInfo) -> dict[str, Any]:
    """The ``Field`` keywords of ``info``'s bounds (``ge``, ``le``, ``gt``, ``lt``,
    ``min_length``, ``max_length``, ``allow_inf_nan``, and what only the schema states)."""
    out: dict[str, Any] = {}
    if info.json_schema_extra is not None:
        out["json_schema_extra"] = info.json_schema_extra
    for item in info.metadata:
        for key in ("ge", "le", "gt", "lt", "min_length", "max_length", "allow_inf_nan"):
            if getattr(item, key, None) is not None:
                out[key] = getattr(item, key)
    return out


def override(name: str, description: str | None = None, also: str | None = None) -> Any:
    """The field of setting ``name`` for a request: the same bounds and meaning (or
    ``description``), and what ``also`` holds of a request's value, unset by default (then
    the server's setting decides)."""
    info = PressSettings.model_fields[name]
    meaning = description or info.description
    if also:
        meaning = f"{meaning}; {also}"
    return Field(
        default=None, description=f"{meaning}. Unset: the server's setting", **bounds(info)
    )


class PressOverrides(JsonBody):
    """What one request may change of :class:`PressSettings` (each field unset by default;
    see there). ``budget`` and ``ratio`` together are refused (and the schema says so)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "not": {
                "required": ["budget", "ratio"],
                "properties": {"budget": {"type": "integer"}, "ratio": {"type": "number"}},
            }
        },
    )

    press: RequestPressName | None = override(
        "default_press", "the press that compresses the prompt's KV"
    )
    budget: int | None = override(
        "budget",
        also="a request's budget below the window (its own or the server's) keeps the last "
        "budget tokens: the window shrinks to the budget",
    )
    ratio: float | None = override("ratio")
    window: int | None = override(
        "window",
        also="at most the budget (the request's or the server's): a larger window shrinks "
        "to the budget",
    )
    kernel: int | None = override("kernel")
    pooling: Literal["max", "avg"] | None = override("pooling")
    keep_instruction: bool | None = override("keep_instruction")
    lookup: bool | None = override("lookup")
    lookahead: int | None = override("lookahead")
    propagate_layer: int | None = override("propagate_layer")
    propagate_share: float | None = override("propagate_share")
    full_prefill: bool | None = override("full_prefill")
    decode_slack: int | None = override("decode_slack")
    decode_window: int | None = override(
        "decode_window",
        also="a request's window over the slack (its own or the server's) is the slack",
    )

    @model_validator(mode="after")
    def _one_size(self) -> PressOverrides:
        if self.budget is not None and self.ratio is not None:
            raise ValueError("give budget or ratio, not both")
        return self


def setting_of(request_name: str) -> str:
    """The :class:`PressSettings` field a :class:`PressOverrides` field overrides."""
    return next((k for k, v in REQUEST_NAMES.items() if v == request_name), request_name)
