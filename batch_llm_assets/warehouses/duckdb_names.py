"""Table names as DuckDB resolves them: asked of DuckDB, not imitated.

DuckDB matches identifiers case-insensitively, quoted ones too (`"NEWS"` is the table `News`),
and looks an unqualified name up in the current schema only (`main`); a two-part name may name a
schema or an attached database, and DuckDB refuses one that names both. The session asks DuckDB
itself (`DESCRIBE`), so every rule holds as DuckDB applies it. When DuckDB finds no such table,
or finds the name ambiguous, the error lists the tables that carry the name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

from ..engine.errors import BatchLLMError
from .base import Columns, check_table


def quoted(table: str) -> str:
    return ".".join('"' + p + '"' for p in check_table(table))


@dataclass(frozen=True)
class Described:
    """A table as DuckDB resolved it: columns (name -> type, in order) and primary key."""

    columns: Columns = field(default_factory=Columns)
    key: frozenset[str] = frozenset()  # lower case


def describe(conn: duckdb.DuckDBPyConnection, table: str) -> Described:
    """Columns and key of `table` as DuckDB resolves it; empty when DuckDB finds no table."""
    try:
        rows = conn.execute(f"DESCRIBE {quoted(table)}").fetchall()
    except duckdb.CatalogException:
        return Described()
    except duckdb.BinderException as exc:  # a two-part name that is a schema and a database
        raise BatchLLMError(
            description=f"Table name {table!r} is ambiguous in DuckDB ({_first_line(exc)}): it "
            f"could be {_listed(tables_named(conn, table))}. Name it in full, as "
            "database.schema.table."
        ) from None
    columns = Columns((name, kind) for name, kind, *_ in rows)
    key = frozenset(name.lower() for name, _kind, _null, k, *_ in rows if k == "PRI")
    return Described(columns, key)


def tables_named(conn: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """Every table or view of every attached database and schema whose name is `table`'s last
    part (ignoring case), as database.schema.table."""
    name = check_table(table)[-1]
    rows = conn.execute(
        "SELECT database_name, schema_name, table_name FROM duckdb_tables() "
        "WHERE lower(table_name) = lower(?) "
        "UNION ALL SELECT database_name, schema_name, view_name FROM duckdb_views() "
        "WHERE NOT internal AND lower(view_name) = lower(?) ORDER BY ALL",
        [name, name],
    ).fetchall()
    return [".".join(r) for r in rows]


def missing_table(conn: duckdb.DuckDBPyConnection, table: str, what: str) -> BatchLLMError:
    """`what` (e.g. "Source table") does not exist as DuckDB resolves it; names the tables of
    that name elsewhere, which DuckDB does not look in for this name."""
    elsewhere = tables_named(conn, table)
    if not elsewhere:
        return BatchLLMError(description=f"{what} {table!r} does not exist.")
    return BatchLLMError(
        description=f"{what} {table!r} does not exist where DuckDB looks for it (an unqualified "
        f"name: the current schema, main); tables of that name: {_listed(elsewhere)}. Name the "
        "one you mean as schema.table (or database.schema.table)."
    )


def _listed(names: list[str]) -> str:
    return " and ".join(", ".join(names).rsplit(", ", 1)) if names else "no table"


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
