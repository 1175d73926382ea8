"""BigQuery sessions: the SQL a partition run needs, on a google-cloud-bigquery client.

- Slices are selected with query parameters; time windows are exact in UTC (TIMESTAMP compared
  as instants, DATETIME and DATE values read as UTC, ISO-8601 strings parsed with their own
  offset or as UTC); names are checked (`check_identifier`, plus a project-id pattern) and
  backquoted.
- Results are read page by page (`result(page_size=chunk_rows)`), never all at once. The REST
  pages are enough here: the LLM, not the read, bounds a partition's speed.
- Results are upserted with one MERGE per partition and chunk (see `bigquery_dml`), from UNNEST
  of an ARRAY<STRUCT> query parameter, into a table clustered by (partition_key, id). No
  streaming inserts: on the real service, rows still in the streaming buffer cannot be updated
  or deleted, so a rerun could not replace them. The pipeline writes at most every
  `write_interval_s` (5 s), so a run issues about one MERGE per interval.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import UTC
from typing import Any

from google.api_core.exceptions import NotFound
from google.cloud import bigquery

from ..engine.errors import BatchLLMError
from .base import (
    Columns,
    OutputTable,
    SliceFilter,
    SourceRef,
    WarehouseSession,
    check_identifier,
    partition_summary_dict,
    partition_summary_sql,
    utc_days,
    utc_window,
)
from .bigquery_dml import merge_sql, run_dml, struct
from .bigquery_lease import BigQueryLeaseStore
from .bigquery_names import (
    ID_TYPES,
    column_type,
    quote_column,
    quote_table,
    table_parts,
)
from .bigquery_tables import BigQueryTables
from .stored_answers import BIGQUERY_MAX_HASHES, bigquery_sql

# One MERGE carries at most this many rows and this many bytes of JSON-encoded parameter values:
# below BigQuery's limits on a query request (10 MB) and on a resolved query (12 MB), and large
# enough that one write interval's answers usually fit one statement (BigQuery runs two mutating
# DML statements per table at a time and queues 20). A single larger row is sent on its own.
MERGE_MAX_ROWS = 20_000
MERGE_MAX_BYTES = 6 * 1024 * 1024
# An ISO-8601 string that carries its own offset (Z, UTC, +05:30, -0500) after a time of day.
_HAS_OFFSET = r"[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?\s*([Zz]|UTC|[+-]\d{2}(:?\d{2})?)$"
# done_hashes looks ids up this many at a time (one ARRAY parameter each).
LOOKUP_MAX_IDS = 10_000


class BigQuerySession(BigQueryTables, WarehouseSession):
    write_interval_s = 5.0  # each MERGE is a job of 1-5 s: about one per interval per run

    def __init__(self, client: bigquery.Client, *, write_interval_s: float | None = None) -> None:
        self.client = client
        if write_interval_s is not None:
            self.write_interval_s = write_interval_s
        self._schemas: dict[str, dict[str, str]] = {}
        self._id_types: dict[str, str] = {}
        self._merge_sql: dict[OutputTable, str] = {}

    # -- helpers -----------------------------------------------------------------------------
    def _query(self, sql: str, params: Sequence[Any] = ()) -> bigquery.QueryJob:
        config = bigquery.QueryJobConfig(query_parameters=list(params))
        return self.client.query(sql, job_config=config)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return [tuple(row.values()) for row in self._query(sql, params).result()]

    def _ref(self, table: str) -> bigquery.TableReference:
        project, dataset, name = table_parts(table)
        return bigquery.DatasetReference(project or self.client.project, dataset).table(name)

    def _dataset_exists(self, ref: bigquery.TableReference) -> bool:
        try:
            self.client.get_dataset(bigquery.DatasetReference(ref.project, ref.dataset_id))
        except NotFound:
            return False
        return True

    def _schema(self, table: str, *, what: str = "Source table") -> dict[str, str]:
        """Column name -> GoogleSQL type, from the table's metadata (no query is run)."""
        if table in self._schemas:
            return self._schemas[table]
        ref = self._ref(table)
        try:
            meta = self.client.get_table(ref)
        except NotFound:
            if not self._dataset_exists(ref):
                raise BatchLLMError(
                    description=f"BigQuery dataset {ref.project}.{ref.dataset_id} does not exist "
                    f"({what.lower()} {table!r})."
                ) from None
            raise BatchLLMError(
                description=f"{what} {table!r} does not exist in BigQuery dataset "
                f"{ref.project}.{ref.dataset_id}."
            ) from None
        schema = Columns((f.name, column_type(f)) for f in meta.schema)
        self._schemas[table] = schema
        return schema

    def _id_type(self, table: str) -> str:
        if table not in self._id_types:
            self._id_types[table] = self._schema(table, what="Output table").get("id", "STRING")
        return self._id_types[table]

    # -- the interface -------------------------------------------------------------------------
    def lease_store(self, output: str) -> BigQueryLeaseStore:
        """Without a shared Redis the partition leases are rows of a table beside the output."""
        project, dataset, _ = table_parts(output)
        return BigQueryLeaseStore(self.client, project or self.client.project, dataset)

    def check_source(self, source: SourceRef) -> None:
        columns = self._schema(source.table)
        wanted = [source.id_column, *source.columns]
        if source.partition_column:
            wanted.append(source.partition_column)
        for column in wanted:
            check_identifier(column)
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise BatchLLMError(
                description=f"Source table {source.table!r} has no column(s) {missing}; "
                f"it has {sorted(columns)}."
            )
        id_type = columns[source.id_column]
        if id_type not in ID_TYPES:
            raise BatchLLMError(
                description=f"Id column {source.table!r}.{source.id_column} has type {id_type}; "
                f"use a column of one of {sorted(ID_TYPES)}."
            )

    def _where(self, source: SourceRef, where: SliceFilter) -> tuple[str, list[Any]]:
        if where.kind == "all":
            return "TRUE", []
        column = where.column or ""
        col = quote_column(column)
        kind = self._schema(source.table).get(column)
        if where.kind == "range":
            return self._window(source, where, col, kind)
        value = where.value
        if kind == "INT64":
            try:
                value = int(value)
            except (TypeError, ValueError):
                raise BatchLLMError(
                    description=f"Partition key {where.value!r} is not an integer, but "
                    f"{source.table!r}.{column} is INT64."
                ) from None
        elif kind == "STRING":
            value = str(value)
        else:
            raise BatchLLMError(
                description=f"Partition column {source.table!r}.{column} has type {kind}: "
                "a static partition key needs a STRING or INT64 column (use time-window "
                "partitions for TIMESTAMP, DATETIME and DATE columns)."
            )
        return f"{col} = @slice_value", [bigquery.ScalarQueryParameter("slice_value", kind, value)]

    def _window(
        self, source: SourceRef, where: SliceFilter, col: str, kind: str | None
    ) -> tuple[str, list[Any]]:
        """[start, end) in UTC: no value here depends on a process's or session's time zone."""
        start, end = utc_window(where)
        cond = f"{col} >= @slice_start AND {col} < @slice_end"
        if kind == "TIMESTAMP":
            ptype, values = "TIMESTAMP", (start.replace(tzinfo=UTC), end.replace(tzinfo=UTC))
        elif kind == "DATETIME":  # wall-clock values, read as UTC
            ptype, values = "DATETIME", (start, end)
        elif kind == "DATE":  # UTC days
            ptype, values = "DATE", utc_days(where, source.table)
        elif kind == "STRING":
            # With an offset the string says which instant it is; without one it is UTC.
            # (TIMESTAMP(s, 'UTC') alone would do on BigQuery; the CASE keeps the emulator exact.)
            parsed = (
                f"(CASE WHEN REGEXP_CONTAINS({col}, r'{_HAS_OFFSET}') "
                f"THEN SAFE_CAST({col} AS TIMESTAMP) ELSE SAFE.TIMESTAMP({col}, 'UTC') END)"
            )
            cond = f"{parsed} >= @slice_start AND {parsed} < @slice_end"
            ptype, values = "TIMESTAMP", (start.replace(tzinfo=UTC), end.replace(tzinfo=UTC))
        else:
            raise BatchLLMError(
                description=f"Partition column {source.table!r}.{where.column} has type {kind}: "
                "a time-window partition needs a TIMESTAMP, DATETIME, DATE or STRING (ISO-8601) "
                "column."
            )
        return cond, [
            bigquery.ScalarQueryParameter("slice_start", ptype, values[0]),
            bigquery.ScalarQueryParameter("slice_end", ptype, values[1]),
        ]

    def slice_stats(self, source: SourceRef, where: SliceFilter) -> tuple[int, list[Any], int]:
        cond, params = self._where(source, where)
        idc = quote_column(source.id_column)
        table = quote_table(source.table)
        [(rows, nulls)] = self._rows(
            f"SELECT COUNT(*), COUNTIF({idc} IS NULL) FROM {table} WHERE {cond}", params
        )
        dups = self._rows(
            f"SELECT {idc} FROM {table} WHERE {cond} AND {idc} IS NOT NULL "
            f"GROUP BY {idc} HAVING COUNT(*) > 1 ORDER BY {idc} LIMIT 5",
            params,
        )
        return rows, [d[0] for d in dups], nulls

    def read_slice(
        self, source: SourceRef, where: SliceFilter, chunk_rows: int
    ) -> Iterator[list[dict[str, Any]]]:
        cond, params = self._where(source, where)
        names = [source.id_column, *source.columns]
        cols = ", ".join(quote_column(c) for c in names)
        job = self._query(
            f"SELECT {cols} FROM {quote_table(source.table)} WHERE {cond} ORDER BY {quote_column(source.id_column)}",
            params,
        )
        for page in job.result(page_size=chunk_rows).pages:
            rows = [dict(zip(names, row.values(), strict=True)) for row in page]
            for i in range(0, len(rows), chunk_rows):  # a page is never more than a chunk
                yield rows[i : i + chunk_rows]

    def done_hashes(
        self, output: OutputTable, partition_key: str, ids: Sequence[Any]
    ) -> dict[Any, str]:
        table = output.name
        if not ids:
            return {}
        id_type = self._id_type(table)
        done: dict[Any, str] = {}
        for i in range(0, len(ids), LOOKUP_MAX_IDS):
            param = bigquery.ArrayQueryParameter("ids", id_type, list(ids[i : i + LOOKUP_MAX_IDS]))
            done.update(
                self._rows(
                    f"SELECT `id`, `request_hash` FROM {quote_table(table)} WHERE `partition_key` = @pk "
                    "AND `status` = 'ok' AND `id` IN UNNEST(@ids)",
                    [param, bigquery.ScalarQueryParameter("pk", "STRING", partition_key)],
                )
            )
        return done

    def stored_answers(
        self, output: OutputTable, hashes: Sequence[str], partition_key: str, *, everywhere: bool
    ) -> dict[str, dict[str, Any]]:
        names, found = output.names, {}
        sql = bigquery_sql(quote_table(output.name), names, quote_column, here=not everywhere)
        for i in range(0, len(hashes), BIGQUERY_MAX_HASHES):
            part = list(hashes[i : i + BIGQUERY_MAX_HASHES])
            params = [bigquery.ArrayQueryParameter("hashes", "STRING", part)]
            if not everywhere:
                params.append(bigquery.ScalarQueryParameter("pk", "STRING", partition_key))
            rows = (dict(zip(names, r, strict=True)) for r in self._rows(sql, params))
            found.update((r["request_hash"], r) for r in rows)
        return found

    def _merge(self, output: OutputTable) -> str:
        if output not in self._merge_sql:
            self._merge_sql[output] = merge_sql(output, quote_table(output.name))
        return self._merge_sql[output]

    def write_results(self, output: OutputTable, rows: list[dict[str, Any]]) -> None:
        """One MERGE per partition and chunk of <= MERGE_MAX_ROWS rows / MERGE_MAX_BYTES."""
        if not rows:
            return
        id_type = self._id_type(output.name)
        # MERGE allows one source row per target row: the last one of a key wins.
        partitions: dict[str, dict[Any, dict[str, Any]]] = {}
        for row in rows:
            partitions.setdefault(row.get("partition_key"), {})[row["id"]] = row
        for pk, latest in partitions.items():
            if not isinstance(pk, str):
                raise BatchLLMError(
                    description=f"Results for {output.name!r} need a partition_key; got {pk!r}."
                )
            chunk: list[bigquery.StructQueryParameter] = []
            size = 0
            for row in latest.values():
                param = struct(row, id_type, output)
                row_size = len(json.dumps(param.to_api_repr()["parameterValue"], default=str))
                if chunk and (len(chunk) >= MERGE_MAX_ROWS or size + row_size > MERGE_MAX_BYTES):
                    self._write_chunk(output, pk, chunk)
                    chunk, size = [], 0
                chunk.append(param)
                size += row_size
            if chunk:
                self._write_chunk(output, pk, chunk)

    def _write_chunk(
        self, output: OutputTable, partition_key: str, chunk: list[bigquery.StructQueryParameter]
    ) -> None:
        params = [
            bigquery.ArrayQueryParameter("rows", "STRUCT", chunk),
            bigquery.ScalarQueryParameter("pk", "STRING", partition_key),
        ]
        sql = self._merge(output)
        run_dml(
            lambda: self._query(sql, params).result(job_retry=None),
            what=f"MERGE of {len(chunk)} rows into {output.name!r} (partition {partition_key!r})",
        )

    def count_output(self, table: str, partition_key: str) -> int:
        [(count,)] = self._rows(
            f"SELECT COUNT(*) FROM {quote_table(table)} WHERE `partition_key` = @partition_key",
            [bigquery.ScalarQueryParameter("partition_key", "STRING", partition_key)],
        )
        return count

    def partition_summary(self, output: str, partition_key: str) -> dict[str, Any]:
        totals_sql, errors_sql, failed_sql, to_date_sql = partition_summary_sql(
            quote_table(output), "@partition_key"
        )
        param = [bigquery.ScalarQueryParameter("partition_key", "STRING", partition_key)]
        [totals] = self._rows(totals_sql, param)
        [to_date] = self._rows(to_date_sql, [])
        errors, failed = self._rows(errors_sql, param), self._rows(failed_sql, param)
        return partition_summary_dict(totals, errors, failed, to_date)

    def null_fractions(
        self, table: str, partition_key: str, columns: list[str]
    ) -> dict[str, float]:
        """Per column, the fraction of the partition's rows where it is NULL (typed outputs; an
        ARRAY column counts an empty array, as BigQuery stores no NULL array)."""
        if not columns:
            return {}
        schema = self._schema(table, what="Output table")
        tests = [
            f"{quote_column(c)} IS NULL OR ARRAY_LENGTH({quote_column(c)}) = 0"
            if schema.get(c, "").startswith("ARRAY")
            else f"{quote_column(c)} IS NULL"
            for c in columns
        ]
        parts = ", ".join(f"AVG(IF({t}, 1.0, 0.0))" for t in tests)
        [row] = self._rows(
            f"SELECT {parts} FROM {quote_table(table)} WHERE `partition_key` = @pk",
            [bigquery.ScalarQueryParameter("pk", "STRING", partition_key)],
        )
        return {c: float(v) if v is not None else 0.0 for c, v in zip(columns, row, strict=True)}

    def list_tables(self, dataset: str, limit: int) -> list[str]:
        """The first `limit` table names of 'dataset' or 'project.dataset', sorted.

        From the tables.list API (free, no query); all pages are read, since the API does not
        promise an order.
        """
        project, name, _ = table_parts(f"{dataset}.t")
        ref = bigquery.DatasetReference(project or self.client.project, name)
        missing = BatchLLMError(
            description=f"BigQuery dataset {ref.project}.{ref.dataset_id} does not exist."
        )
        try:
            # Asked first: some emulators list a missing dataset as empty instead of a 404.
            self.client.get_dataset(ref)
            names = [t.table_id for t in self.client.list_tables(ref, page_size=1000)]
        except NotFound:
            raise missing from None
        return sorted(names)[: max(0, limit)]
