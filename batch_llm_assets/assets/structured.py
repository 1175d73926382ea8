"""Typed outputs: one internal spec for `output_schema`, its JSON Schema, validation, columns.

`output_schema` is either a pydantic model class (Python) or a mapping field -> type (YAML):

    label: {type: enum, values: [positive, negative, neutral], description: ...}
    confidence: {type: number, minimum: 0, maximum: 1}
    tickers: {type: list, items: string}
    details: object            # any JSON object, stored as JSON

Both forms become one `OutputSchema`: a strict-compatible JSON Schema for the request (every
field required, additionalProperties false), a validator for the answer, and one typed output
column per field (logical types of warehouses/: string, int, float, bool, json, list<...>).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ..engine.constraints import schema_note
from ..engine.errors import BatchLLMError
from ..engine.structured import shape_request
from ..warehouses.base import check_identifier
from .violations import json_object, violation

SCALARS = ("string", "integer", "number", "boolean")
KINDS = (*SCALARS, "enum", "list", "object")
# JSON type -> logical column type of warehouses/ (enum is stored as a string).
_COLUMN = {"string": "string", "integer": "int", "number": "float", "boolean": "bool"}
_JSON_TYPE = {"enum": "string", "object": "object"}


class OutputSchemaError(BatchLLMError, ValueError):
    """An `output_schema` that cannot be turned into typed columns; says which field and why."""


@dataclass(frozen=True)
class FieldSpec:
    """One field of the answer: its kind, and for enums, lists and numbers what narrows it."""

    name: str
    kind: str
    description: str | None = None
    values: tuple[Any, ...] = ()  # enum
    items: str | None = None  # list: a scalar kind (or "enum" with values)
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False  # the answer may say null (Optional[X]; `nullable: true` in YAML)

    @property
    def column_type(self) -> str:
        if self.kind == "list":
            return f"list<{_COLUMN.get(self.items or '', 'string')}>"
        if self.kind == "object":
            return "json"
        return _COLUMN.get(self.kind, "string")

    def annotation(self) -> Any:
        """The Python type an answer's value must have (bounds included)."""
        if self.nullable:
            return dataclasses.replace(self, nullable=False).annotation() | None
        if self.kind == "list":
            return list[
                FieldSpec(self.name, self.items or "string", values=self.values).annotation()
            ]
        if self.kind == "enum":
            return Literal[self.values]  # type: ignore[valid-type]
        if self.kind == "object":
            return dict[str, Any]
        py = {"string": str, "integer": int, "number": float, "boolean": bool}[self.kind]
        return Annotated[py, Field(ge=self.minimum, le=self.maximum)]

    def json_schema(self) -> dict[str, Any]:
        if self.nullable:  # strict mode takes a union with null, not an optional property
            inner = dataclasses.replace(self, nullable=False, description=None).json_schema()
            out = {"anyOf": [inner, {"type": "null"}]}
            return out | ({"description": self.description} if self.description else {})
        if self.kind == "list":
            item = FieldSpec(self.name, self.items or "string", values=self.values)
            out: dict[str, Any] = {"type": "array", "items": item.json_schema()}
        elif self.kind == "enum":
            out = {"type": _JSON_TYPE["enum"], "enum": list(self.values)}
        elif self.kind == "object":
            # Strict mode needs declared properties; a free-form object is carried as JSON text.
            out = {"type": "object"}
        else:
            out = {"type": self.kind}
            if self.minimum is not None:
                out["minimum"] = self.minimum
            if self.maximum is not None:
                out["maximum"] = self.maximum
        if self.description:
            out["description"] = self.description
        return out


@dataclass(frozen=True)
class OutputSchema:
    """The parsed `output_schema`: fields in order, and the pydantic model when one was given."""

    fields: tuple[FieldSpec, ...]
    name: str = "output"
    model: type[BaseModel] | None = field(default=None, compare=False)

    def json_schema(self) -> dict[str, Any]:
        """Strict-compatible: every field required, no other properties."""
        return {
            "type": "object",
            "properties": {f.name: f.json_schema() for f in self.fields},
            "required": [f.name for f in self.fields],
            "additionalProperties": False,
        }

    @property
    def strict_ok(self) -> bool:
        """OpenAI's strict mode needs declared properties: a free-form object field rules it out."""
        return all(f.kind != "object" for f in self.fields)

    def columns(self) -> tuple[tuple[str, str], ...]:
        return tuple((f.name, f.column_type) for f in self.fields)

    def descriptions(self) -> dict[str, str]:
        return {f.name: f.description for f in self.fields if f.description}

    def parse(self, text: str | None) -> dict[str, Any]:
        """The answer's field values; raises a Violation (a ValueError) naming what is wrong."""
        doc = json_object(text)
        for model in (m for m in (self._checker, self.model) if m is not None):  # the user's too
            try:
                doc = model.model_validate(doc).model_dump(mode="json")
            except ValidationError as exc:
                raise violation(exc.errors(include_url=False)[0]) from None
        return {f.name: doc.get(f.name) for f in self.fields}

    @functools.cached_property
    def _checker(self) -> type[BaseModel]:
        """A strict pydantic model of exactly the JSON Schema sent: what every answer must meet."""
        return create_model(  # type: ignore[call-overload]
            "Answer",
            __config__=ConfigDict(strict=True, extra="forbid"),
            **{f.name: (f.annotation(), ...) for f in self.fields},
        )

    def shape(
        self, provider_kind: str, messages: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The request's structured params and messages, in the provider's form."""
        schema, strict = self.json_schema(), self.strict_ok
        return shape_request(
            provider_kind, schema, messages, {}, name=self.name, strict=strict, note=self._note
        )

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """A typed request's part of its identity: the schema asked for, in no provider's form
        (a change of form, of the note's wording or of the detected server re-sends nothing)."""
        return {"output_schema": {"name": self.name, "schema": self.json_schema()}}

    @functools.cached_property
    def _note(self) -> str:
        """The schema's constraints for the system prompt: worked out once, not once a row."""
        return schema_note(self.json_schema()) or ""

    def result_values(self, ok: bool, text: str | None) -> dict[str, Any]:
        """Column values of a row: a valid ok answer's fields, NULLs for a failed row."""
        return self.row_values(text) if ok else dict.fromkeys(self.names)

    def row_values(self, text: str | None) -> dict[str, Any]:
        """Column values of a valid answer (objects as JSON text); NULLs for anything else."""
        try:
            values = self.parse(text)
        except ValueError:
            return dict.fromkeys(self.names)
        return {
            f.name: json.dumps(values[f.name]) if f.kind == "object" else values[f.name]
            for f in self.fields
        }

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]


# -- parsing the two forms ---------------------------------------------------------------------
def parse_output_schema(
    value: type[BaseModel] | Mapping[str, Any] | OutputSchema | None,
    *,
    reserved: Sequence[str] = (),
) -> OutputSchema | None:
    """A pydantic model class or a YAML-style mapping -> OutputSchema (None stays None).

    `reserved` are the output table's own column names, which a field may not take.
    """
    if value is None or isinstance(value, OutputSchema):
        return value
    if isinstance(value, type) and issubclass(value, BaseModel):
        spec = _from_json_schema(value.model_json_schema(), name=value.__name__)
        spec = OutputSchema(spec.fields, name=spec.name, model=value)
    elif isinstance(value, Mapping):
        if not value:
            raise OutputSchemaError(description="output_schema has no fields.")
        spec = OutputSchema(tuple(_yaml_field(str(k), v) for k, v in value.items()))
    else:
        raise OutputSchemaError(
            description=f"output_schema must be a pydantic model class or a mapping of field -> "
            f"type, got {type(value).__name__}."
        )
    _check_fields(spec, reserved)
    return spec


def _check_fields(spec: OutputSchema, reserved: Sequence[str]) -> None:
    """Names the warehouse can hold side by side (DuckDB and BigQuery compare column names
    ignoring case: `Status` is the `status` column), and bounds an answer can meet."""
    taken = {name.lower(): f"the output column {name!r}" for name in ("id", *reserved)}
    for f in spec.fields:
        check_identifier(f.name, "output_schema field")
        if f.name.lower() in taken:
            raise OutputSchemaError(
                description=f"output_schema field {f.name!r} clashes with {taken[f.name.lower()]}"
                f" (column names ignore case); rename it (reserved: id, {', '.join(reserved)})."
            )
        taken[f.name.lower()] = f"the field {f.name!r}"
        for which in ("minimum", "maximum"):
            if getattr(f, which) is not None and not math.isfinite(getattr(f, which)):
                raise OutputSchemaError(
                    description=f"output_schema field {f.name!r}: {which} must be a finite "
                    f"number, got {getattr(f, which)!r}."
                )


def _yaml_field(name: str, value: Any) -> FieldSpec:
    """`string` | `{type: ..., description, values, items, minimum, maximum}`."""
    where = f"output_schema.{name}"
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, Mapping) or "type" not in value:
        raise OutputSchemaError(
            description=f"{where}: expected a type name or a mapping with 'type' (one of "
            f"{', '.join(KINDS)}), got {value!r}."
        )
    keys = {"type", "description", "values", "items", "minimum", "maximum", "nullable"}
    unknown = set(value) - keys
    if unknown:
        raise OutputSchemaError(description=f"{where}: unknown key(s) {sorted(unknown)}.")
    kind = value["type"]
    if kind not in KINDS:
        raise OutputSchemaError(
            description=f"{where}: unknown type {kind!r}; use one of {', '.join(KINDS)}."
        )
    values = tuple(value.get("values") or ())
    items = value.get("items")
    if kind == "list":
        if isinstance(items, Mapping):  # list of enum: items: {type: enum, values: [...]}
            values = tuple(items.get("values") or ())
            items = items.get("type")
        if items not in (*SCALARS, "enum"):
            raise OutputSchemaError(
                description=f"{where}: a list needs items: one of {', '.join(SCALARS)} or enum."
            )
    if (kind == "enum" or items == "enum") and (
        not values or not all(isinstance(v, str) for v in values)
    ):
        raise OutputSchemaError(description=f"{where}: an enum needs values: a list of strings.")
    bounds = {k: value.get(k) for k in ("minimum", "maximum")}
    for k, bound in bounds.items():
        if bound is not None and (kind not in ("integer", "number") or isinstance(bound, bool)):
            raise OutputSchemaError(description=f"{where}: {k} applies to integer/number only.")
        if bound is not None and not isinstance(bound, int | float):
            raise OutputSchemaError(description=f"{where}: {k} must be a number, got {bound!r}.")
    if None not in bounds.values() and bounds["minimum"] > bounds["maximum"]:
        raise OutputSchemaError(description=f"{where}: minimum is above maximum.")
    return FieldSpec(
        name,
        kind,
        description=value.get("description"),
        values=values,
        items=items,
        minimum=bounds["minimum"],
        maximum=bounds["maximum"],
        nullable=bool(value.get("nullable", False)),
    )


def _from_json_schema(schema: dict[str, Any], *, name: str) -> OutputSchema:
    """A pydantic model's JSON Schema -> fields (refs resolved, Optional[X] read as X)."""
    defs = schema.get("$defs", {})

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items()}}
            node.pop("$ref")
        for combo in ("anyOf", "oneOf"):
            options = [o for o in node.get(combo, ()) if o.get("type") != "null"]
            if len(options) == 1:
                inner = resolve(options[0])
                node = {**inner, "description": node.get("description") or inner.get("description")}
        return node

    fields = []
    for fname, prop in schema.get("properties", {}).items():
        node = resolve(prop)
        where = f"output_schema {name}.{fname}"
        kind = node.get("type")
        values: tuple[Any, ...] = tuple(node.get("enum", ()))
        items = None
        if values:
            kind = "enum"
        elif kind == "array":
            item = resolve(node.get("items") or {})
            items = "enum" if item.get("enum") else item.get("type")
            values = tuple(item.get("enum", ()))
            if items not in (*SCALARS, "enum"):
                raise OutputSchemaError(
                    description=f"{where}: lists of {items or 'mixed values'} are not supported; "
                    "use a list of str, int, float, bool or an enum."
                )
            kind = "list"
        elif kind not in (*SCALARS, "object"):
            raise OutputSchemaError(
                description=f"{where}: type {kind or node} is not supported; use str, int, "
                "float, bool, an Enum/Literal, a list of those, or a dict/model (stored as JSON)."
            )
        lo = node.get("minimum", node.get("exclusiveMinimum"))
        hi = node.get("maximum", node.get("exclusiveMaximum"))
        nullable = any(o.get("type") == "null" for o in prop.get("anyOf", ()))
        fields.append(
            FieldSpec(fname, kind, node.get("description"), values, items, lo, hi, nullable)
        )
    if not fields:
        raise OutputSchemaError(description=f"output_schema {name} has no fields.")
    return OutputSchema(tuple(fields), name=name)


# -- metadata and checks -------------------------------------------------------------------------
def column_schema(base: dg.TableSchema, spec: OutputSchema | None) -> dg.TableSchema:
    """The output table's column schema with the typed columns appended, with descriptions."""
    if spec is None:
        return base
    typed = [
        dg.TableColumn(f.name, f.column_type, description=f.description or f"answer field {f.kind}")
        for f in spec.fields
    ]
    return dg.TableSchema(columns=[*base.columns, *typed])


def field_quality(
    session: Any, output: str, partition_key: str, fields: Sequence[str]
) -> dict[str, float]:
    """Per field, the fraction of the partition's rows whose value is NULL (invalid answers and
    failed rows have NULL fields). The checks and the metadata read it."""
    return session.null_fractions(output, partition_key, list(fields))


def quality_metadata(fractions: Mapping[str, float]) -> dict[str, Any]:
    return {
        f"batch_llm/null_fraction/{name}": dg.MetadataValue.float(round(value, 6))
        for name, value in fractions.items()
    }


def field_check_specs(
    key: dg.AssetKey, spec: OutputSchema | None, pdef: dg.PartitionsDefinition | None = None
) -> list[dg.AssetCheckSpec]:
    """One check per field and partition, evaluated inside its run: its NULL fraction."""
    if spec is None:
        return []
    return [
        dg.AssetCheckSpec(
            f"{f.name}_null_fraction",
            asset=key,
            partitions_def=pdef,
            description=f"Rows of the partition whose {f.name!r} is NULL (failed or invalid "
            "answers) are at most max_failed_fraction.",
        )
        for f in spec.fields
    ]


def field_check_results(
    key: dg.AssetKey, fractions: Mapping[str, float], max_null_fraction: float
) -> list[dg.AssetCheckResult]:
    return [
        dg.AssetCheckResult(
            asset_key=key,
            check_name=f"{name}_null_fraction",
            passed=value <= max_null_fraction,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"null_fraction": value, "max_null_fraction": max_null_fraction},
        )
        for name, value in fractions.items()
    ]
