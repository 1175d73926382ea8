"""BigQuery writes: one MERGE per partition and chunk, retried when BigQuery says "later".

Each MERGE is restricted to its partition (`T.partition_key = @pk` in the ON clause), so on a
table clustered by (partition_key, id) it reads only that partition's blocks, and two partition
runs writing the same table touch disjoint rows. BigQuery still serialises mutating DML per table
(two run at once, up to 20 queue); what it refuses for now is retried with backoff:
- 400 invalidQuery "Could not serialize access to table ... due to concurrent update" (a
  concurrent DML statement changed the table underneath this one);
- "Transaction is aborted due to concurrent update" (the same, inside a transaction);
- 403 rateLimitExceeded / jobRateLimitExceeded ("Exceeded rate limits: too many table update
  operations for this table", "Too many DML statements outstanding against table"): BigQuery's
  short-term limits, whose documented remedy is to retry after a few seconds with exponential
  backoff;
- backendError / internalError / badGateway: transient service errors.
A MERGE is an idempotent upsert, so running it again after an unclear failure is safe.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import bigquery

from ..engine.errors import BatchLLMError
from .base import OutputTable, check_identifier
from .bigquery_types import TYPES

# Retries of one DML statement: exponential backoff with full jitter, capped, within a deadline.
DML_RETRY_FIRST_S = 1.0
DML_RETRY_MAX_S = 32.0
DML_RETRY_DEADLINE_S = 600.0

_RETRY_REASONS = frozenset(
    {"rateLimitExceeded", "jobRateLimitExceeded", "backendError", "internalError", "badGateway"}
)
_RETRY_MESSAGES = (
    "could not serialize access",
    "due to concurrent update",
    "too many dml statements outstanding",
    "exceeded rate limits",
)


def _q(column: str) -> str:
    return "`" + check_identifier(column) + "`"


def is_retryable(exc: BaseException) -> bool:
    """True for BigQuery's "try again later" answers to a DML statement."""
    if not isinstance(exc, gexc.GoogleAPICallError):
        return False
    if isinstance(exc, gexc.TooManyRequests | gexc.ServiceUnavailable | gexc.BadGateway):
        return True
    reasons = {e.get("reason") for e in (exc.errors or []) if isinstance(e, dict)}
    if reasons & _RETRY_REASONS:
        return True
    texts = [exc.message or "", *(str(e.get("message", "")) for e in exc.errors or [])]
    return any(m in t.lower() for t in texts for m in _RETRY_MESSAGES)


_sleep = time.sleep  # the backoff's pause (tests record it instead)


def run_dml(run: Callable[[], Any], *, what: str, deadline_s: float | None = None) -> Any:
    """run() until it succeeds, retrying retryable BigQuery errors with capped backoff."""
    deadline = time.monotonic() + (DML_RETRY_DEADLINE_S if deadline_s is None else deadline_s)
    attempt = 0
    while True:
        try:
            return run()
        except gexc.GoogleAPICallError as exc:
            cap = min(DML_RETRY_MAX_S, DML_RETRY_FIRST_S * 2**attempt)
            delay = cap * random.uniform(0.5, 1.0)  # jittered: writers that collided spread out
            if not is_retryable(exc):
                raise
            if time.monotonic() + delay > deadline:
                raise BatchLLMError(
                    description=f"{what}: BigQuery kept refusing it for {attempt + 1} attempts "
                    f"(last: {exc.message}); the rows stay in the run's journal for the next run."
                ) from exc
            attempt += 1
            _sleep(delay)


def merge_sql(output: OutputTable, table_sql: str) -> str:
    """MERGE of @rows into one partition (@pk) of the output table, keyed by (partition_key, id)."""
    names = output.names
    fields = ", ".join(f"r.{_q(c)} AS {_q(c)}" for c in names)
    updates = ", ".join(f"{_q(c)} = S.{_q(c)}" for c in names[1:] if c != "partition_key")
    return (
        f"MERGE {table_sql} AS T "
        f"USING (SELECT {fields} FROM UNNEST(@rows) AS r) AS S "
        "ON T.`partition_key` = @pk AND T.`id` = S.`id` "
        f"WHEN MATCHED THEN UPDATE SET {updates} "
        f"WHEN NOT MATCHED THEN INSERT ({', '.join(_q(c) for c in names)}) "
        f"VALUES ({', '.join(f'S.{_q(c)}' for c in names)})"
    )


def struct(row: dict[str, Any], id_type: str, output: OutputTable) -> bigquery.StructQueryParameter:
    fields = [bigquery.ScalarQueryParameter("id", id_type, row["id"])]
    for column, kind in output.columns:
        value = row.get(column)
        if kind == "timestamp" and isinstance(value, datetime) and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        if kind.startswith("list<"):
            item = TYPES[kind].removeprefix("ARRAY<").removesuffix(">")
            items = [] if value is None else value.tolist() if hasattr(value, "tolist") else value
            fields.append(bigquery.ArrayQueryParameter(column, item, list(items)))
            continue
        fields.append(bigquery.ScalarQueryParameter(column, TYPES[kind], value))
    return bigquery.StructQueryParameter(None, *fields)
