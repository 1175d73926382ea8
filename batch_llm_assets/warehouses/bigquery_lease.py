"""Partition leases in BigQuery itself, for runs on several hosts without a shared Redis.

One row per lease in `<output dataset>._batch_llm_leases` (name, holder, expires_at). A claim is
one MERGE that writes the row only if it is missing, lapsed (by BigQuery's clock, so the hosts'
clocks do not matter), already the claimant's, or a dead holder's it replaces; the statement's
affected-row count says whether it did. Mutating DML statements on one table are serialised by
BigQuery (a conflicting concurrent one fails with "could not serialize access" and is retried,
`bigquery_dml.run_dml`): of two runs claiming at once, the second sees the first's row.
"""

from __future__ import annotations

import contextlib

from google.api_core.exceptions import Conflict
from google.cloud import bigquery

from ..engine import _constants as C
from .base import LeaseStore, check_identifier
from .bigquery_dml import is_retryable, run_dml

LEASE_TABLE = "_batch_llm_leases"

_EXPIRY = "TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL @ttl_ms MILLISECOND)"


class BigQueryLeaseStore(LeaseStore):
    def __init__(
        self, client: bigquery.Client, project: str, dataset: str, *, ttl_s: float | None = None
    ) -> None:
        self.client = client
        self.ttl_s = C.LEASE_WAREHOUSE_TTL_S if ttl_s is None else ttl_s
        check_identifier(dataset, "dataset")
        self.table = f"`{project}`.`{dataset}`.`{LEASE_TABLE}`"
        self._dataset = f"`{project}`.`{dataset}`"
        self.where = f"BigQuery table {project}.{dataset}.{LEASE_TABLE}"
        self._ready = False

    def _run(self, sql: str, params: list[bigquery.ScalarQueryParameter], what: str):
        def go() -> bigquery.QueryJob:
            config = bigquery.QueryJobConfig(query_parameters=params)
            job = self.client.query(sql, job_config=config)
            job.result(job_retry=None)
            return job

        return run_dml(go, what=what, deadline_s=C.LEASE_TAKE_OUTAGE_S)

    def _ensure(self) -> None:
        if self._ready:
            return
        for sql in (
            f"CREATE SCHEMA IF NOT EXISTS {self._dataset}",
            f"CREATE TABLE IF NOT EXISTS {self.table} "
            "(name STRING, holder STRING, expires_at TIMESTAMP)",
        ):
            with contextlib.suppress(Conflict):  # a concurrent run created it first
                self._run(sql, [], what=sql.split(" (")[0])
        self._ready = True

    def claim(self, name: str, holder: str, *, replacing: str | None = None) -> str | None:
        self._ensure()
        params = [
            bigquery.ScalarQueryParameter("name", "STRING", name),
            bigquery.ScalarQueryParameter("holder", "STRING", holder),
            bigquery.ScalarQueryParameter("replacing", "STRING", replacing or ""),
            bigquery.ScalarQueryParameter("ttl_ms", "INT64", max(1, int(self.ttl_s * 1000))),
        ]
        merge = (
            f"MERGE {self.table} AS T USING (SELECT @name AS name) AS S ON T.name = S.name "
            "WHEN MATCHED AND (T.expires_at <= CURRENT_TIMESTAMP() OR T.holder = @holder "
            f"OR T.holder = @replacing) THEN UPDATE SET holder = @holder, expires_at = {_EXPIRY} "
            f"WHEN NOT MATCHED THEN INSERT (name, holder, expires_at) "
            f"VALUES (@name, @holder, {_EXPIRY})"
        )
        for _ in range(3):  # again if the holder released it between the MERGE and the read
            job = self._run(merge, params, what=f"Claiming a partition lease in {self.where}")
            if job.num_dml_affected_rows:
                return None
            rows = self.client.query(
                f"SELECT holder FROM {self.table} WHERE name = @name",
                job_config=bigquery.QueryJobConfig(query_parameters=params[:1]),
            ).result()
            current = next((row[0] for row in rows), None)
            if current:
                return current
        return ""  # refused: an unknown holder

    def release(self, name: str, holder: str) -> None:
        self._run(
            f"DELETE FROM {self.table} WHERE name = @name AND holder = @holder",
            [
                bigquery.ScalarQueryParameter("name", "STRING", name),
                bigquery.ScalarQueryParameter("holder", "STRING", holder),
            ],
            what=f"Releasing a partition lease in {self.where}",
        )

    def transient(self, exc: BaseException) -> bool:
        return is_retryable(exc)
