"""BigQuery names and types: checked project/dataset/table names, backquoting, and the
GoogleSQL type names DDL spells."""

from __future__ import annotations

from google.cloud import bigquery

from .base import PROJECT_ID, InvalidIdentifierError, check_identifier, check_table

# The REST API's legacy type names -> GoogleSQL names.
LEGACY_TYPES = {"INTEGER": "INT64", "FLOAT": "FLOAT64", "BOOLEAN": "BOOL", "RECORD": "STRUCT"}
# Types an id column may have: usable as a MERGE key and as a query parameter.
ID_TYPES = frozenset(
    {"INT64", "STRING", "NUMERIC", "BIGNUMERIC", "BYTES", "DATE", "DATETIME", "TIMESTAMP"}
)
CLUSTERABLE = frozenset(
    {"INT64", "STRING", "NUMERIC", "BIGNUMERIC", "DATE", "DATETIME", "TIMESTAMP"}
)


def check_project(project: str) -> str:
    if not isinstance(project, str) or not PROJECT_ID.fullmatch(project):
        raise InvalidIdentifierError(
            description=f"Invalid BigQuery project id {project!r}: 6-30 lowercase letters, "
            "digits and hyphens, starting with a letter (no quotes, backticks or semicolons)."
        )
    return project


def table_parts(table: str) -> tuple[str | None, str, str]:
    """'dataset.table' or 'project.dataset.table' -> (project or None, dataset, table), checked."""
    parts = table.split(".") if isinstance(table, str) else [table]
    if len(parts) == 3:
        check_project(parts[0])
        dataset, name = check_table(".".join(parts[1:]), max_parts=2)
        return parts[0], dataset, name
    if len(parts) == 2:
        dataset, name = check_table(table, max_parts=2)
        return None, dataset, name
    raise InvalidIdentifierError(
        description=f"Invalid BigQuery table name {table!r}: expected 'dataset.table' or "
        "'project.dataset.table'."
    )


def column_type(f: bigquery.SchemaField) -> str:
    """A field's GoogleSQL type as DDL spells it (REPEATED INT64 -> ARRAY<INT64>)."""
    kind = LEGACY_TYPES.get(f.field_type, f.field_type)
    return f"ARRAY<{kind}>" if f.mode == "REPEATED" else kind


def quote_name(name: str) -> str:
    return "`" + name + "`"


def quote_column(column: str) -> str:
    return quote_name(check_identifier(column))


def quote_table(table: str) -> str:
    project, dataset, name = table_parts(table)
    return ".".join(quote_name(p) for p in (project, dataset, name) if p is not None)
