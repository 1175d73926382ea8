"""DuckDB sessions: the SQL a partition run needs, on one connection (one writer at a time)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import duckdb
import pandas as pd

from ..engine.errors import BatchLLMError
from .base import (
    OutputTable,
    SliceFilter,
    SourceRef,
    WarehouseSession,
    check_identifier,
    check_table,
)

_NULLABLE = {"int": "Int64", "float": "Float64"}
_TYPES = {"string": "VARCHAR", "int": "BIGINT", "float": "DOUBLE", "timestamp": "TIMESTAMPTZ"}


def _q(name: str) -> str:
    return '"' + check_identifier(name) + '"'


def _qt(table: str) -> str:
    return ".".join('"' + p + '"' for p in check_table(table))


class DuckDBSession(WarehouseSession):
    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self.conn = conn
        # Reads stream on their own cursor; lookups and writes share this one from worker
        # threads, and a DuckDB connection must not be used by two threads at once.
        self._lock = threading.Lock()

    def _columns(self, table: str) -> dict[str, str]:
        parts = check_table(table)
        name, schema = parts[-1], (parts[-2] if len(parts) > 1 else None)
        sql = "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ?"
        params: list[Any] = [name]
        if schema:
            sql += " AND table_schema = ?"
            params.append(schema)
        return dict(self.conn.execute(sql, params).fetchall())

    def check_source(self, source: SourceRef) -> None:
        columns = self._columns(source.table)
        if not columns:
            raise BatchLLMError(description=f"Source table {source.table!r} does not exist.")
        wanted = [source.id_column, *source.columns]
        if source.partition_column:
            wanted.append(source.partition_column)
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise BatchLLMError(
                description=f"Source table {source.table!r} has no column(s) {missing}; "
                f"it has {sorted(columns)}."
            )

    @staticmethod
    def _where(where: SliceFilter) -> tuple[str, list[Any]]:
        if where.kind == "all":
            return "TRUE", []
        col = _q(where.column or "")
        if where.kind == "range":
            return f"{col} >= ? AND {col} < ?", [where.start, where.end]
        return f"{col} = ?", [where.value]

    def slice_stats(self, source: SourceRef, where: SliceFilter) -> tuple[int, list[Any], int]:
        cond, params = self._where(where)
        idc = _q(source.id_column)
        table = _qt(source.table)
        rows, nulls = self.conn.execute(
            f"SELECT count(*), count(*) FILTER (WHERE {idc} IS NULL) FROM {table} WHERE {cond}",
            params,
        ).fetchone()
        dups = self.conn.execute(
            f"SELECT {idc} FROM {table} WHERE {cond} AND {idc} IS NOT NULL "
            f"GROUP BY {idc} HAVING count(*) > 1 ORDER BY {idc} LIMIT 5",
            params,
        ).fetchall()
        return rows, [d[0] for d in dups], nulls

    def read_slice(
        self, source: SourceRef, where: SliceFilter, chunk_rows: int
    ) -> Iterator[list[dict[str, Any]]]:
        cond, params = self._where(where)
        names = [source.id_column, *source.columns]
        cols = ", ".join(_q(c) for c in names)
        cursor = self.conn.cursor()  # its own cursor: writes go through self.conn meanwhile
        try:
            cursor.execute(
                f"SELECT {cols} FROM {_qt(source.table)} WHERE {cond} ORDER BY {_q(source.id_column)}",
                params,
            )
            while batch := cursor.fetchmany(chunk_rows):
                yield [dict(zip(names, row, strict=True)) for row in batch]
        finally:
            cursor.close()

    def ensure_output(self, output: OutputTable, source: SourceRef) -> None:
        id_type = self._columns(source.table).get(source.id_column, "VARCHAR")
        table = output.name
        parts = check_table(table)
        if len(parts) > 1:
            self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {'.'.join(_q(p) for p in parts[:-1])}")
        cols = ", ".join(f"{_q(c)} {_TYPES[t]}" for c, t in output.columns)
        self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {_qt(table)} (id {id_type} PRIMARY KEY, {cols})"
        )

    def done_hashes(
        self, output: OutputTable, partition_key: str, ids: Sequence[Any]
    ) -> dict[Any, str]:
        if not ids:
            return {}
        with self._lock:
            return self._done_hashes(output.name, ids)

    def _done_hashes(self, table: str, ids: Sequence[Any]) -> dict[Any, str]:
        self.conn.register("_bla_wanted", pd.DataFrame({"id": list(ids)}))
        try:
            rows = self.conn.execute(
                f"SELECT o.id, o.request_hash FROM {_qt(table)} o "
                "JOIN _bla_wanted w ON o.id = w.id WHERE o.status = 'ok'"
            ).fetchall()
        finally:
            self.conn.unregister("_bla_wanted")
        return dict(rows)

    def write_results(self, output: OutputTable, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with self._lock:
            self._write(output, rows)

    def _write(self, output: OutputTable, rows: list[dict[str, Any]]) -> None:
        table = output.name
        frame = pd.DataFrame(rows, columns=output.names)
        for col, kind in output.columns:  # nullable dtypes: a missing number is NULL, not NaN
            if kind in _NULLABLE:
                frame[col] = frame[col].astype(_NULLABLE[kind])
        names = ", ".join(["id", *(_q(c) for c, _ in output.columns)])
        self.conn.register("_bla_results", frame)
        try:
            # One statement, one transaction: a crash leaves the chunk all written or not at all.
            self.conn.execute(
                f"INSERT OR REPLACE INTO {_qt(table)} ({names}) SELECT {names} FROM _bla_results"
            )
        finally:
            self.conn.unregister("_bla_results")

    def count_output(self, table: str, partition_key: str) -> int:
        return self.conn.execute(
            f"SELECT count(*) FROM {_qt(table)} WHERE partition_key = ?", [partition_key]
        ).fetchone()[0]

    def list_tables(self, dataset: str, limit: int) -> list[str]:
        return self.list_tables_page(dataset, None, limit)

    def list_tables_page(self, dataset: str, after: str | None, limit: int) -> list[str]:
        check_identifier(dataset, "dataset (schema)")
        with self._lock:
            exists = self.conn.execute(
                "SELECT count(*) FROM information_schema.schemata WHERE schema_name = ?", [dataset]
            ).fetchone()[0]
            if not exists:
                raise BatchLLMError(description=f"Dataset (schema) {dataset!r} does not exist.")
            rows = self.conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = ? "
                "AND table_name > ? ORDER BY table_name LIMIT ?",
                [dataset, after or "", limit],
            ).fetchall()
        return [r[0] for r in rows]
