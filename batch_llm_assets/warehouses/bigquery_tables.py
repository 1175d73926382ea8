"""BigQuery DDL a session runs: the output table (created clustered, brought up to date) and
the Batch API state table. A mixin of BigQuerySession, whose _query, _rows, _ref, _schema and
_dataset_exists it uses."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from google.api_core.exceptions import BadRequest, Conflict, NotFound, PreconditionFailed
from google.cloud import bigquery

from ..engine.errors import BatchLLMError
from .base import BATCH_STATE_COLUMNS, BATCH_STATE_KEY, OutputTable, SourceRef
from .bigquery_dml import TYPES as _TYPES
from .bigquery_dml import run_dml
from .bigquery_names import CLUSTERABLE, quote_column, quote_name, quote_table, table_parts


class BigQueryTables:
    def ensure_output(self, output: OutputTable, source: SourceRef) -> None:
        """Create the table clustered by (partition_key, id); bring an older one up to date.

        Keys live only in the MERGE, so a table of the older layout (clustered by id) keeps its
        rows; its clustering is switched to (partition_key, id), which BigQuery applies to data
        written from then on. Columns the output schema gained are added (nullable); a column
        whose type changed is refused, naming it and both types.
        """
        table = output.name
        id_type = self._schema(source.table)[source.id_column]
        ref = self._ref(table)
        if not self._dataset_exists(ref):
            project, dataset, _ = table_parts(table)  # no project part: the client's project
            qds = ".".join(quote_name(p) for p in (project, dataset) if p is not None)
            self._ddl(f"CREATE SCHEMA IF NOT EXISTS {qds}")
        cols = ", ".join(f"{quote_column(c)} {_TYPES[t]}" for c, t in output.columns)
        # Clustered by partition first: each MERGE and done-row lookup reads only its partition's
        # blocks; then by request_hash, for the stored-answers lookup of a partition.
        key = ["partition_key", "request_hash"] + (["id"] if id_type in CLUSTERABLE else [])
        cluster = " CLUSTER BY " + ", ".join(quote_column(c) for c in key)
        self._ddl(
            f"CREATE TABLE IF NOT EXISTS {quote_table(table)} (`id` {id_type}, {cols}){cluster}"
        )
        self._schemas.pop(table, None)
        existing = self._schema(table, what="Output table")
        wanted = {"id": id_type, **{c: _TYPES[t] for c, t in output.columns}}
        wrong = {c: existing[c] for c, t in wanted.items() if c in existing and existing[c] != t}
        if "id" not in existing or wrong:
            diffs = ", ".join(f"{c} is {t}, expected {wanted[c]}" for c, t in wrong.items())
            raise BatchLLMError(
                description=f"Output table {table!r} exists with a different schema: "
                f"{diffs or 'no id column'}. Rename or drop it (a new one is created), or alter "
                "those columns."
            )
        missing = [(c, t) for c, t in wanted.items() if c not in existing]
        # DDL, not the tables API: bqemulator applies only DDL to its storage; one statement per
        # column, as bqemulator takes only one ALTER command per statement.
        for c, t in missing:
            sql = f"ALTER TABLE {quote_table(table)} ADD COLUMN IF NOT EXISTS {quote_column(c)} {t}"
            run_dml(lambda sql=sql: self._add_column(sql), what=f"Adding {c} to {table!r}")
        if missing:
            self._schemas.pop(table, None)
        run_dml(lambda: self._cluster(ref, key), what=f"Clustering {table!r} by {key}")
        self._id_types[table] = id_type

    def _add_column(self, sql: str) -> None:
        """A column a concurrent run (or a stale schema read: bqemulator's metadata can lag its
        storage) already added is fine: IF NOT EXISTS is not honoured everywhere."""
        try:
            self._query(sql).result()
        except BadRequest as exc:
            if "already exists" not in str(exc):
                raise

    def _ddl(self, sql: str) -> None:
        """CREATE ... IF NOT EXISTS, which a concurrent run's identical statement may race."""
        try:
            run_dml(lambda: self._query(sql).result(), what=sql.split(" (")[0])
        except Conflict:  # "Already Exists": the other run created it first
            pass

    def _cluster(self, ref: bigquery.TableReference, key: list[str]) -> None:
        """Cluster by `key` (from now on: BigQuery reclusters data written after the change)."""
        meta = self.client.get_table(ref)
        if list(meta.clustering_fields or []) == key:
            return
        meta.clustering_fields = key
        try:
            self.client.update_table(meta, ["clustering_fields"])
        except PreconditionFailed:  # another run changed the table meanwhile: look again
            self._cluster(ref, key)

    # -- Batch API state (issue 13) ---------------------------------------------------------
    def ensure_batch_state(self, table: str) -> None:
        ref = self._ref(table)
        if not self._dataset_exists(ref):
            project, dataset, _ = table_parts(table)
            qds = ".".join(quote_name(p) for p in (project, dataset) if p is not None)
            self._ddl(f"CREATE SCHEMA IF NOT EXISTS {qds}")
        cols = ", ".join(f"{quote_column(c)} {_TYPES[t]}" for c, t in BATCH_STATE_COLUMNS)
        self._ddl(f"CREATE TABLE IF NOT EXISTS {quote_table(table)} ({cols})")

    def put_batch_state(self, table: str, record: dict[str, Any]) -> None:
        """One MERGE on the key: a DML statement, so the row is durable when it returns."""
        names = [c for c, _ in BATCH_STATE_COLUMNS]
        params = []
        for column, kind in BATCH_STATE_COLUMNS:
            value = record.get(column)
            if kind == "timestamp" and value is not None and value.tzinfo is None:
                value = value.replace(tzinfo=UTC)
            params.append(bigquery.ScalarQueryParameter(column, _TYPES[kind], value))
        on = " AND ".join(f"T.{quote_column(c)} = @{c}" for c in BATCH_STATE_KEY)
        sets = ", ".join(f"{quote_column(c)} = @{c}" for c in names if c not in BATCH_STATE_KEY)
        sql = (
            f"MERGE {quote_table(table)} AS T USING (SELECT 1) AS S ON {on} "
            f"WHEN MATCHED THEN UPDATE SET {sets} "
            f"WHEN NOT MATCHED THEN INSERT ({', '.join(quote_column(c) for c in names)}) "
            f"VALUES ({', '.join('@' + c for c in names)})"
        )
        run_dml(
            lambda: self._query(sql, params).result(job_retry=None),
            what=f"Recording batch state in {table!r}",
        )

    def batch_states(
        self, table: str, asset: str, partition_key: str | None = None, *, open_only: bool = False
    ) -> list[dict[str, Any]]:
        names = [c for c, _ in BATCH_STATE_COLUMNS]
        try:
            self.client.get_table(self._ref(table))
        except NotFound:
            return []
        sql = f"SELECT {', '.join(quote_column(c) for c in names)} FROM {quote_table(table)} WHERE `asset` = @asset"
        params = [bigquery.ScalarQueryParameter("asset", "STRING", asset)]
        if partition_key is not None:
            sql += " AND `partition_key` = @pk"
            params.append(bigquery.ScalarQueryParameter("pk", "STRING", partition_key))
        if open_only:
            sql += " AND `state` IN ('uploaded', 'submitted')"
        rows = self._rows(sql + " ORDER BY `created_at`, `intent_id`", params)
        return [dict(zip(names, row, strict=True)) for row in rows]
