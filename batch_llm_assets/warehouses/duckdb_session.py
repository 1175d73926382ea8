"""DuckDB sessions: the SQL a partition run needs, on one connection (one writer at a time).

- Output rows are keyed by (partition_key, id): the table's primary key. A table of the older
  layout (PRIMARY KEY (id)) is rebuilt with the new key in one transaction.
- Time-window slices select [start, end) in UTC whatever the process's or the connection's
  TimeZone: naive TIMESTAMP and DATE values are read as UTC, ISO-8601 strings without an offset
  too; the window's bounds are sent as naive UTC values, never as local times.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import duckdb

from ..engine.errors import BatchLLMError
from .base import (
    BATCH_STATE_COLUMNS,
    BATCH_STATE_KEY,
    OUTPUT_KEY,
    Columns,
    OutputTable,
    SliceFilter,
    SourceRef,
    WarehouseSession,
    check_identifier,
    check_table,
    partition_summary_dict,
    partition_summary_sql,
    utc_days,
    utc_window,
)
from .duckdb_names import Described, describe, missing_table
from .duckdb_names import quoted as _qt
from .duckdb_types import SPELLED as _SPELLED
from .duckdb_types import TYPES as _TYPES
from .duckdb_types import WIDER, arrow_table, frame
from .stored_answers import DUCKDB_MAX_HASHES, duckdb_index_sql, duckdb_sql

_NAIVE_TIMESTAMPS = frozenset({"TIMESTAMP", "TIMESTAMP_NS", "TIMESTAMP_MS", "TIMESTAMP_S"})
_FLOATS = frozenset({"FLOAT", "DOUBLE", "REAL"})
# An ISO-8601 string that ends in a UTC offset (Z, +05:30, -0500, +01) after a time of day.
_HAS_OFFSET = r"[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?\s*([Zz]|[+-]\d{2}(:?\d{2})?)$"


def _q(name: str) -> str:
    return '"' + check_identifier(name) + '"'


class DuckDBSession(WarehouseSession):
    write_interval_s = 1.0
    reads_on_loop = True

    def __init__(
        self, conn: duckdb.DuckDBPyConnection | Callable[[], duckdb.DuckDBPyConnection]
    ) -> None:
        """`conn`, or a function that opens it at first use: a partition run takes its lease
        before it touches the database, so a second run of the partition is refused at once
        instead of waiting on DuckDB's file lock."""
        self._conn = conn if isinstance(conn, duckdb.DuckDBPyConnection) else None
        self._connect = None if self._conn is not None else conn
        self._opening = threading.Lock()
        # Reads stream on their own cursor; lookups and writes share this one from worker
        # threads, and a DuckDB connection must not be used by two threads at once.
        self._lock = threading.Lock()

    @property
    def conn(self) -> duckdb.DuckDBPyConnection:
        if self._conn is None:
            with self._opening:
                if self._conn is None:
                    self._conn = self._connect()  # type: ignore[misc]
        return self._conn

    def _described(self, table: str) -> Described:
        """The table as DuckDB resolves the name (case, search path, attached databases)."""
        return describe(self.conn, table)

    def check_source(self, source: SourceRef) -> None:
        found = self._described(source.table)
        if not found.columns:
            raise missing_table(self.conn, source.table, "Source table")
        wanted = [source.id_column, *source.columns]
        if source.partition_column:
            wanted.append(source.partition_column)
        missing = [c for c in wanted if c not in found.columns]
        if missing:
            raise BatchLLMError(
                description=f"Source table {source.table!r} has no column(s) {missing}; "
                f"it has {sorted(found.columns)}."
            )

    def _where(self, source: SourceRef, where: SliceFilter) -> tuple[str, list[Any]]:
        if where.kind == "all":
            return "TRUE", []
        column = where.column or ""
        col = _q(column)
        if where.kind == "equals":
            return f"{col} = ?", [where.value]
        kind = self._described(source.table).columns.get(column, "")
        start, end = utc_window(where)
        if kind in _NAIVE_TIMESTAMPS:  # wall-clock values, read as UTC
            return f"{col} >= CAST(? AS TIMESTAMP) AND {col} < CAST(? AS TIMESTAMP)", [start, end]
        if kind == "TIMESTAMP WITH TIME ZONE":  # instants: compared as instants
            bound = "(CAST(? AS TIMESTAMP) AT TIME ZONE 'UTC')"
            return f"{col} >= {bound} AND {col} < {bound}", [start, end]
        if kind == "DATE":
            days = utc_days(where, source.table)
            return f"{col} >= CAST(? AS DATE) AND {col} < CAST(? AS DATE)", list(days)
        if kind == "VARCHAR":
            parsed = (
                f"(CASE WHEN regexp_matches({col}, '{_HAS_OFFSET}') "
                f"THEN TRY_CAST({col} AS TIMESTAMPTZ) "
                f"ELSE TRY_CAST({col} AS TIMESTAMP) AT TIME ZONE 'UTC' END)"
            )
            bound = "(CAST(? AS TIMESTAMP) AT TIME ZONE 'UTC')"
            return f"{parsed} >= {bound} AND {parsed} < {bound}", [start, end]
        raise BatchLLMError(
            description=f"Partition column {source.table!r}.{column} has type {kind or 'unknown'}: "
            "a time-window partition needs a TIMESTAMP, TIMESTAMPTZ, DATE or VARCHAR (ISO-8601) "
            "column."
        )

    def slice_stats(self, source: SourceRef, where: SliceFilter) -> tuple[int, list[Any], int]:
        cond, params = self._where(source, where)
        idc = _q(source.id_column)
        table = _qt(source.table)
        bad = f"{idc} IS NULL"
        if self._described(source.table).columns.get(source.id_column) in _FLOATS:
            bad = f"({bad} OR isnan({idc}) OR isinf({idc}))"
        rows, bad_ids = self.conn.execute(
            f"SELECT count(*), count(*) FILTER (WHERE {bad}) FROM {table} WHERE {cond}",
            params,
        ).fetchone()
        dups = self.conn.execute(
            f"SELECT {idc} FROM {table} WHERE {cond} AND NOT {bad} "
            f"GROUP BY {idc} HAVING count(*) > 1 ORDER BY {idc} LIMIT 5",
            params,
        ).fetchall()
        return rows, [d[0] for d in dups], bad_ids

    def read_slice(
        self, source: SourceRef, where: SliceFilter, chunk_rows: int
    ) -> Iterator[list[dict[str, Any]]]:
        cond, params = self._where(source, where)
        names = [source.id_column, *source.columns]
        cols = ", ".join(_q(c) for c in names)
        cursor = self.conn.cursor()  # its own cursor: writes go through self.conn meanwhile
        try:
            # Streamed in the table's order, not sorted: a sort holds the whole slice in
            # DuckDB's memory for the run (25 MB at 300,000 headlines, counted against its
            # memory_limit). Nothing depends on the order: done rows are known by id.
            cursor.execute(f"SELECT {cols} FROM {_qt(source.table)} WHERE {cond}", params)
            while batch := cursor.fetchmany(chunk_rows):
                yield [dict(zip(names, row, strict=True)) for row in batch]
        finally:
            cursor.close()

    # -- the output table --------------------------------------------------------------------
    def ensure_output(self, output: OutputTable, source: SourceRef) -> None:
        """Create the table keyed by (partition_key, id); bring an older one up to date.

        An older table keyed by id alone is rebuilt with the new key (one transaction); columns
        the output schema gained are added (nullable); a column whose type changed is refused.
        """
        table = output.name
        parts = check_table(table)
        with self._lock:
            found = self._described(table)
            existing = found.columns
            if not existing:
                id_type = self._described(source.table).columns.get(source.id_column) or "VARCHAR"
                if len(parts) > 1:
                    schema = ".".join(_q(p) for p in parts[:-1])
                    self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
                cols = ", ".join(f"{_q(c)} {_TYPES[t]}" for c, t in output.columns)
                key = ", ".join(_q(c) for c in OUTPUT_KEY)
                self.conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {_qt(table)} "
                    f"(id {id_type}, {cols}, PRIMARY KEY ({key}))"
                )
                self.conn.execute(duckdb_index_sql(table, _q, _qt))
                return
            self._check_types(table, existing, output)
            key = found.key
            if key == {"id"}:
                self._rekey(table, existing)
            elif key != set(OUTPUT_KEY):
                raise BatchLLMError(
                    description=f"Output table {table!r} has primary key "
                    f"{sorted(key) or 'none'}; "
                    f"results are keyed by {list(OUTPUT_KEY)}. Rename or drop it (a new one is "
                    "created), or rebuild it with PRIMARY KEY (partition_key, id)."
                )
            for column, kind in output.columns:
                if column not in existing:
                    self.conn.execute(
                        f"ALTER TABLE {_qt(table)} ADD COLUMN {_q(column)} {_TYPES[kind]}"
                    )
            self.conn.execute(duckdb_index_sql(table, _q, _qt))  # an older table gets it now

    @staticmethod
    def _check_types(table: str, existing: Columns, output: OutputTable) -> None:
        if "id" not in existing:
            raise BatchLLMError(description=f"Output table {table!r} has no id column.")
        wrong = []
        for column, kind in output.columns:
            want = _SPELLED.get(_TYPES[kind], _TYPES[kind])
            have = existing.get(column)
            if have is not None and have != want and have not in WIDER.get(want, ()):
                wrong.append(f"{column} is {have}, expected {want}")
        if wrong:
            raise BatchLLMError(
                description=f"Output table {table!r} exists with a different schema: "
                f"{', '.join(wrong)}. Rename or drop it (a new one is created), or alter those "
                "columns."
            )

    def _rekey(self, table: str, existing: Columns) -> None:
        """Rebuild a table keyed by id alone with the (partition_key, id) key, atomically."""
        if "partition_key" not in existing:
            raise BatchLLMError(
                description=f"Output table {table!r} is keyed by id alone and has no "
                "partition_key column, so its rows cannot be told apart by partition. Rename "
                "or drop it (a new one is created)."
            )
        parts = check_table(table)
        old = parts[-1] + "__bla_rekey"
        qold = ".".join([*('"' + p + '"' for p in parts[:-1]), _q(old)])
        cols = ", ".join(f"{_q(c)} {t}" for c, t in existing.items())
        names = ", ".join(_q(c) for c in existing)
        key = ", ".join(_q(c) for c in OUTPUT_KEY)
        self.conn.execute("BEGIN TRANSACTION")
        try:
            self.conn.execute(f"ALTER TABLE {_qt(table)} RENAME TO {_q(old)}")
            self.conn.execute(f"CREATE TABLE {_qt(table)} ({cols}, PRIMARY KEY ({key}))")
            self.conn.execute(f"INSERT INTO {_qt(table)} ({names}) SELECT {names} FROM {qold}")
            self.conn.execute(f"DROP TABLE {qold}")
            self.conn.execute("COMMIT")
        except duckdb.Error as exc:
            self.conn.execute("ROLLBACK")
            raise BatchLLMError(
                description=f"Output table {table!r} is keyed by id alone (an older layout) and "
                f"could not be rebuilt with the key (partition_key, id): {exc}. Nothing was "
                "changed; fill its NULL partition_key values, or rename or drop it."
            ) from None

    def done_hashes(
        self, output: OutputTable, partition_key: str, ids: Sequence[Any]
    ) -> dict[Any, str]:
        if not ids:
            return {}
        with self._lock:
            import pandas as pd  # here, not at import: see duckdb_types.frame

            self.conn.register("_bla_wanted", pd.DataFrame({"id": list(ids)}))
            try:
                rows = self.conn.execute(
                    f"SELECT o.id, o.request_hash FROM {_qt(output.name)} o "
                    "JOIN _bla_wanted w ON o.id = w.id "
                    "WHERE o.partition_key = ? AND o.status = 'ok'",
                    [partition_key],
                ).fetchall()
            finally:
                self.conn.unregister("_bla_wanted")
        return dict(rows)

    def stored_answers(
        self, output: OutputTable, hashes: Sequence[str], partition_key: str, *, everywhere: bool
    ) -> dict[str, dict[str, Any]]:
        names, found = output.names, {}
        for i in range(0, len(hashes), DUCKDB_MAX_HASHES):
            part = list(hashes[i : i + DUCKDB_MAX_HASHES])
            sql = duckdb_sql(_qt(output.name), names, len(part), _q, here=not everywhere)
            params = part if everywhere else [partition_key, *part, partition_key]
            with self._lock:
                rows = self.conn.execute(sql, params).fetchall()
            found.update(
                (r["request_hash"], r) for r in (dict(zip(names, t, strict=True)) for t in rows)
            )
        return found

    def write_results(self, output: OutputTable, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with self._lock:
            self._write(output, rows)

    def _write(self, output: OutputTable, rows: list[dict[str, Any]]) -> None:
        # One source row per key: an upsert may not touch the same row twice in one statement.
        latest = list({(row.get("partition_key"), row["id"]): row for row in rows}.values())
        try:
            data: Any = arrow_table(output, latest)
        except Exception:  # a value Arrow will not take as typed: pandas, DuckDB casts it
            data = frame(output, latest)
        names = ", ".join(["id", *(_q(c) for c, _ in output.columns)])
        self.conn.register("_bla_results", data)
        try:
            # One statement, one transaction: a crash leaves the chunk all written or not at all.
            self.conn.execute(
                f"INSERT OR REPLACE INTO {_qt(output.name)} ({names}) "
                f"SELECT {names} FROM _bla_results"
            )
        finally:
            self.conn.unregister("_bla_results")

    def count_output(self, table: str, partition_key: str) -> int:
        return self.conn.execute(
            f"SELECT count(*) FROM {_qt(table)} WHERE partition_key = ?", [partition_key]
        ).fetchone()[0]

    def partition_summary(self, output: str, partition_key: str) -> dict[str, Any]:
        totals_sql, errors_sql, failed_sql, to_date_sql = partition_summary_sql(_qt(output), "?")
        with self._lock:
            totals = self.conn.execute(totals_sql, [partition_key]).fetchone()
            errors = self.conn.execute(errors_sql, [partition_key]).fetchall()
            failed = self.conn.execute(failed_sql, [partition_key]).fetchall()
            to_date = self.conn.execute(to_date_sql).fetchone()
        return partition_summary_dict(totals, errors, failed, to_date)

    def null_fractions(
        self, table: str, partition_key: str, columns: list[str]
    ) -> dict[str, float]:
        """Per column, the fraction of the partition's rows where it is NULL (typed outputs)."""
        if not columns:
            return {}
        parts = ", ".join(f"avg(CASE WHEN {_q(c)} IS NULL THEN 1.0 ELSE 0.0 END)" for c in columns)
        with self._lock:
            row = self.conn.execute(
                f"SELECT {parts} FROM {_qt(table)} WHERE partition_key = ?", [partition_key]
            ).fetchone()
        return {c: float(v) if v is not None else 0.0 for c, v in zip(columns, row, strict=True)}

    def list_tables(self, dataset: str, limit: int) -> list[str]:
        return self.list_tables_page(dataset, None, limit)

    def list_tables_page(self, dataset: str, after: str | None, limit: int) -> list[str]:
        check_identifier(dataset, "dataset (schema)")
        with self._lock:
            # The current database's schema of that name, matched as DuckDB matches names.
            here = "catalog_name = current_database() AND lower(schema_name) = lower(?)"
            exists = self.conn.execute(
                f"SELECT count(*) FROM information_schema.schemata WHERE {here}", [dataset]
            ).fetchone()[0]
            if not exists:
                raise BatchLLMError(description=f"Dataset (schema) {dataset!r} does not exist.")
            rows = self.conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_catalog = "
                "current_database() AND lower(table_schema) = lower(?) AND table_name > ? "
                "ORDER BY table_name LIMIT ?",
                [dataset, after or "", limit],
            ).fetchall()
        return [r[0] for r in rows]

    # -- Batch API state (issue 13) ---------------------------------------------------------
    def ensure_batch_state(self, table: str) -> None:
        parts = check_table(table)
        cols = ", ".join(f"{_q(c)} {_TYPES[t]}" for c, t in BATCH_STATE_COLUMNS)
        key = ", ".join(_q(c) for c in BATCH_STATE_KEY)
        with self._lock:
            if len(parts) > 1:
                self.conn.execute(
                    f"CREATE SCHEMA IF NOT EXISTS {'.'.join(_q(p) for p in parts[:-1])}"
                )
            self.conn.execute(
                f"CREATE TABLE IF NOT EXISTS {_qt(table)} ({cols}, PRIMARY KEY ({key}))"
            )

    def put_batch_state(self, table: str, record: dict[str, Any]) -> None:
        names = [c for c, _ in BATCH_STATE_COLUMNS]
        marks = ", ".join("?" for _ in names)
        with self._lock:
            self.conn.execute(
                f"INSERT OR REPLACE INTO {_qt(table)} ({', '.join(_q(c) for c in names)}) "
                f"VALUES ({marks})",
                [record.get(c) for c in names],
            )

    def batch_states(
        self, table: str, asset: str, partition_key: str | None = None, *, open_only: bool = False
    ) -> list[dict[str, Any]]:
        names = [c for c, _ in BATCH_STATE_COLUMNS]
        with self._lock:
            if not self._described(table).columns:
                return []
            sql = f"SELECT {', '.join(_q(c) for c in names)} FROM {_qt(table)} WHERE asset = ?"
            params: list[Any] = [asset]
            if partition_key is not None:
                sql += " AND partition_key = ?"
                params.append(partition_key)
            if open_only:
                sql += " AND state IN ('uploaded', 'submitted')"
            rows = self.conn.execute(sql + " ORDER BY created_at, intent_id", params).fetchall()
        return [dict(zip(names, row, strict=True)) for row in rows]
