"""The schema's constraints in words: stated in the system prompt, quoted in the repair turn.

A server that constrains decoding to a JSON Schema guarantees the answer's shape, but the model
never reads the schema. llama.cpp's grammars/README.md: "The JSON schema is only used to
constrain the model output and is not injected into the prompt. The model has no visibility
into the schema, so if you want it to understand the expected structure, describe it explicitly
in your prompt"; its grammar enforces minimum/maximum "only for integer, not number" and skips
what it does not support silently. A small model then writes confidence 10 for a field described
"0 to 1". So:
- `schema_note` states each constrained field (description, enum, bounds) in one line for the
  system prompt, `- confidence: number in [0, 1] - how sure the label is`, bounded in size
  (SCHEMA_NOTE_* in _constants.py);
- a `Violation` is an answer's broken rule: where, which rule, the bound and the value, said
  compactly (`"confidence" was 10; it must be <= 1`) for the repair turn and the row's error,
  and keyed by field and rule for the breaker, which stops a run whose rows all fail alike.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from . import _constants as C

NOTE_HEADER = "The JSON answer's fields must meet these constraints:"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
_MAX_REFS = 8  # a $ref chain (or cycle) is followed this far


# -- the note for the system prompt ---------------------------------------------------------------
def schema_note(schema: Any) -> str | None:
    """The schema's constrained fields, one line each (description, enum, numeric and length
    bounds, pattern, optional), or None when none is constrained. At most SCHEMA_NOTE_MAX_LINES
    lines and SCHEMA_NOTE_MAX_CHARS characters, SCHEMA_NOTE_MAX_DEPTH levels deep; what is left
    out is said in a last line. A bound that is not a finite number raises ValueError naming it
    (JSON cannot carry NaN, and no answer meets it)."""
    if not isinstance(schema, dict):
        return None
    walk = _Walk(schema)
    walk.visit(schema, "", 0, required=True)
    if not walk.lines:
        return None
    more = ["- (more constraints not listed)"] if walk.omitted else []
    return "\n".join([NOTE_HEADER, *walk.lines, *more])


class _Walk:
    """Depth-first over the schema's properties and items, within the note's bounds."""

    def __init__(self, root: dict[str, Any]) -> None:
        defs: dict[str, Any] = {}
        for key in ("definitions", "$defs"):
            if isinstance(root.get(key), dict):
                defs.update(root[key])
        self.defs = defs
        self.lines: list[str] = []
        self.chars = 0
        self.nodes = 0
        self.omitted = False
        self._required: dict[int, tuple[list[Any], set[str]]] = {}  # the list kept: its id stays

    @property
    def full(self) -> bool:
        return (
            len(self.lines) >= C.SCHEMA_NOTE_MAX_LINES
            or self.chars >= C.SCHEMA_NOTE_MAX_CHARS
            or self.nodes >= C.SCHEMA_NOTE_MAX_NODES
        )

    def visit(self, node: Any, path: str, depth: int, *, required: bool) -> None:
        if self.full:
            self.omitted = True
            return
        node, nullable = self.resolve(node)
        if path:
            line = _line(path, node, nullable=nullable, required=required)
            if line is not None:
                self.add(line)
        props = node.get("properties")
        items = node.get("items")
        if not isinstance(props, dict) and not isinstance(items, dict):
            return
        if depth >= C.SCHEMA_NOTE_MAX_DEPTH:
            self.omitted = True
            return
        if isinstance(props, dict):
            wanted = self.required(node.get("required"))
            for name, sub in props.items():
                if self.full:
                    self.omitted = True
                    return
                self.visit(sub, _join(path, str(name)), depth + 1, required=name in wanted)
        if isinstance(items, dict):
            self.visit(items, f"{path}[]", depth + 1, required=True)

    def required(self, names: Any) -> set[str]:
        """A `required` list as a set, built once per list (a $ref cycle meets it again)."""
        if not isinstance(names, list):
            return set()
        if id(names) not in self._required:
            self._required[id(names)] = (names, {n for n in names if isinstance(n, str)})
        return self._required[id(names)][1]

    def resolve(self, node: Any) -> tuple[dict[str, Any], bool]:
        """The node with local $refs and single-option anyOf/oneOf/allOf merged in (the outer
        keys win: pydantic puts a field's description beside its anyOf), and whether null is
        allowed."""
        nullable = False
        for _ in range(_MAX_REFS):
            self.nodes += 1
            if not isinstance(node, dict):
                return {}, nullable
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                target = self.defs.get(ref.rsplit("/", 1)[-1])
                rest = {k: v for k, v in node.items() if k != "$ref"}
                node = {**(target if isinstance(target, dict) else {}), **rest}
                continue
            combo = next((k for k in ("anyOf", "oneOf", "allOf") if k in node), None)
            options = node.get(combo) if combo else None
            if not isinstance(options, list):
                return node, nullable
            real = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
            nullable = nullable or len(real) < len(options)
            rest = {k: v for k, v in node.items() if k != combo}
            if len(real) != 1:
                return rest, nullable
            node = {**(real[0] if isinstance(real[0], dict) else {}), **rest}
        return (node if isinstance(node, dict) else {}), nullable

    def add(self, line: str) -> None:
        if self.chars + len(line) + 1 > C.SCHEMA_NOTE_MAX_CHARS:
            self.omitted = True
            self.chars = C.SCHEMA_NOTE_MAX_CHARS
            return
        self.lines.append(line)
        self.chars += len(line) + 1


def _line(path: str, node: dict[str, Any], *, nullable: bool, required: bool) -> str | None:
    """`- path: what it must be (optional) - description`, or None when nothing constrains it."""
    kind = node.get("type")
    if isinstance(kind, list):
        nullable = nullable or "null" in kind
        kinds = [k for k in kind if isinstance(k, str) and k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    kind = kind if isinstance(kind, str) else None
    parts = []
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list) and values:
        parts.append(f"one of {_values(values)}")
    span = _range(node, path)
    if span:
        parts.append(f"{kind or 'number'} {span}")
    for lo, hi, what, unit in (
        ("minLength", "maxLength", "string", "characters"),
        ("minItems", "maxItems", "list", "items"),
    ):
        size = _size(node, lo, hi, path)
        if size:
            parts.append(f"{what} {size} {unit}")
    if isinstance(node.get("pattern"), str):
        parts.append(f"matching {_json(node['pattern'], C.SCHEMA_NOTE_TEXT_CHARS)}")
    step = _number(node, "multipleOf", path)
    if step is not None:
        parts.append(f"a multiple of {step}")
    description = node.get("description")
    description = description if isinstance(description, str) and description.strip() else None
    if not parts and description is None:
        return None
    text = "; ".join(parts) or kind or "a value"
    text += ", or null" if nullable else ""
    text += " (optional)" if not required else ""
    if description is not None:
        text += f" - {clean(description, C.SCHEMA_NOTE_TEXT_CHARS)}"
    return f"- {clean(path, C.SCHEMA_NOTE_TEXT_CHARS)}: {text}"


def _range(node: dict[str, Any], path: str) -> str | None:
    """`in [0, 1]`, `> 0`, `<= 5`: minimum/maximum and their exclusive forms (draft 4's
    boolean `exclusiveMinimum: true` beside `minimum` too)."""
    lo, lo_ex = _bound(node, "minimum", "exclusiveMinimum", path)
    hi, hi_ex = _bound(node, "maximum", "exclusiveMaximum", path)
    if lo is not None and hi is not None:
        return f"in {'(' if lo_ex else '['}{lo}, {hi}{')' if hi_ex else ']'}"
    if lo is not None:
        return f"{'>' if lo_ex else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_ex else '<='} {hi}"
    return None


def _bound(node: dict[str, Any], key: str, exclusive: str, path: str) -> tuple[str | None, bool]:
    flag = node.get(exclusive)
    if isinstance(flag, bool):
        return _number(node, key, path), flag
    value = _number(node, exclusive, path)
    return (value, True) if value is not None else (_number(node, key, path), False)


def _size(node: dict[str, Any], lo_key: str, hi_key: str, path: str) -> str | None:
    lo, hi = _number(node, lo_key, path), _number(node, hi_key, path)
    if hi is not None:
        return f"of {lo} to {hi}" if lo not in (None, "0") else f"of at most {hi}"
    return f"of at least {lo}" if lo not in (None, "0") else None


def _number(node: dict[str, Any], key: str, path: str) -> str | None:
    """The keyword's number as text; None when absent, not a number, or beyond +-2^63 (no
    answer's value is checked against those by any server); ValueError when not finite."""
    value = node.get(key)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(
            f"the output schema's {key} of {clean(path, C.SCHEMA_NOTE_TEXT_CHARS)!r} is "
            f"{value!r}; a bound must be a finite number"
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or abs(value) >= 2**63:
        return None
    return number_text(value)


def number_text(value: float) -> str:
    """1 for 1.0, 0.5 for 0.5: a bound as a person writes it (a huge integer by its size)."""
    if isinstance(value, int) and abs(value) >= 2**63:
        return (
            f"about 2^{value.bit_length() - 1}"
            if value > 0
            else f"about -2^{value.bit_length() - 1}"
        )
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(value)


def _values(values: list[Any]) -> str:
    """Enum values as JSON, comma-separated, cut at SCHEMA_NOTE_TEXT_CHARS with a count of the
    rest."""
    shown: list[str] = []
    used = 0
    for i, v in enumerate(values):
        text = _json(v, C.SCHEMA_NOTE_TEXT_CHARS // 4)
        if shown and used + len(text) > C.SCHEMA_NOTE_TEXT_CHARS:
            return f"{', '.join(shown)}, ... ({len(values) - i} more)"
        shown.append(text)
        used += len(text) + 2
    return ", ".join(shown)


def _join(path: str, name: str) -> str:
    if _IDENTIFIER.fullmatch(name):
        return f"{path}.{name}" if path else name
    return f"{path}[{_json(name, C.SCHEMA_NOTE_TEXT_CHARS)}]"


# -- text, bounded and printable ----------------------------------------------------------------
def clean(text: str, cap: int) -> str:
    """At most `cap` characters of one line of valid Unicode: lone surrogates become U+FFFD
    (a request body must be UTF-8), control characters a space, the cut an ellipsis."""
    cut = len(text) > cap
    text = text[: cap - 1] if cut else text
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    text = _CONTROL.sub(" ", text)
    return f"{text}…" if cut else text


def _json(value: Any, cap: int) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return clean(text, cap)


def field_path(loc: Sequence[str | int], *, any_index: bool = False) -> str:
    """`tickers[0]`, `details.score`, `["odd name"]` for a validation error's location; with
    `any_index`, `tickers[]` (the breaker's key: the same field of any row)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += "[]" if any_index else f"[{part}]"
        else:
            path = _join(path, str(part))
    return clean(path, C.SCHEMA_NOTE_TEXT_CHARS)


# -- what an answer broke ------------------------------------------------------------------------
_MUST = {
    "maximum": "<= {}",
    "exclusiveMaximum": "< {}",
    "minimum": ">= {}",
    "exclusiveMinimum": "> {}",
    "multipleOf": "a multiple of {}",
    "maxLength": "at most {} characters long",
    "minLength": "at least {} characters long",
    "maxItems": "a list of at most {} items",
    "minItems": "a list of at least {} items",
    "pattern": "a string matching {}",
    "enum": "one of {}",
    "type": "{}",
}


class Violation(ValueError):
    """The rule an answer broke. `str()` is the compact message for the repair turn and the
    row's error (`"confidence" was 10; it must be <= 1`), bounded whatever the answer's size;
    `key` is the field and rule, which the breaker compares across rows; `summary` names them
    for the breaker's message (`at "confidence" (maximum 1)`)."""

    def __init__(self, message: str, *, key: str, summary: str) -> None:
        super().__init__(message)
        self.key = key
        self.summary = summary


def broken(
    loc: Sequence[str | int],
    rule: str,
    *,
    bound: Any = None,
    value: Any = None,
    detail: str | None = None,
) -> Violation:
    """The Violation of `rule` (a JSON Schema keyword: maximum, enum, required, type, ...) at
    `loc` by `value`; `bound` is the keyword's value, `detail` the validator's own words for a
    rule this module does not phrase."""
    where = field_path(loc)
    subject = f'"{where}"' if where else "the answer"
    shown = bound if isinstance(bound, str) else number_text(bound) if _numeric(bound) else None
    shown = clean(shown, C.REPAIR_VALUE_MAX_CHARS) if shown is not None else None
    if rule == "required":
        message = f"{subject} is missing; it is required"
    elif rule == "additionalProperties":
        message = f"{subject} is not a field of the answer; leave it out"
    else:
        was = f"{subject} was {_json(value, C.REPAIR_VALUE_MAX_CHARS)}"
        if rule in _MUST and shown is not None:
            message = f"{was}; it must be {_MUST[rule].format(shown)}"
        else:
            message = f"{was}; {clean(detail or rule, C.REPAIR_VALUE_MAX_CHARS * 2)}"
    label = rule if shown is None else f"type: {shown}" if rule == "type" else f"{rule} {shown}"
    return Violation(
        message,
        key=f"{field_path(loc, any_index=True)}|{rule}",
        summary=f"at {subject} ({label})" if where else f"({label})",
    )


def unparsable(message: str, *, rule: str = "json") -> Violation:
    """An answer that is not a JSON object at all (or was cut at max_tokens): no field to name."""
    summary = {"json": "the answers are not valid JSON", "max_tokens": "answers cut at max_tokens"}
    return Violation(
        clean(message, C.REPAIR_VALUE_MAX_CHARS * 3),
        key=f"|{rule}",
        summary=f"({summary.get(rule, rule)})",
    )


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
