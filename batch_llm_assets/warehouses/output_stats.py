"""What an output table says about the answers stored so far, for the cost estimate: whether it
exists yet, and how long the answers that were paid for are (their mean completion tokens).

One read-only query, the same SQL in both dialects; nothing is created when the table is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.errors import BatchLLMError
from .base import WarehouseSession

# The answers that were paid for: ok, sent by this row (not shared from another), with usage.
_SQL = (
    "SELECT COUNT(*), AVG(completion_tokens) FROM {table} WHERE status = 'ok' "
    "AND shared_from IS NULL AND completion_tokens IS NOT NULL"
)


@dataclass(frozen=True)
class StoredAnswers:
    """The paid answers of an output table: how many, and their mean completion tokens."""

    answers: int
    mean_completion_tokens: float | None


def stored_answer_stats(session: WarehouseSession, table: str) -> StoredAnswers | None:
    """The output table's paid answers, or None when the table does not exist yet."""
    from .duckdb_session import DuckDBSession

    if isinstance(session, DuckDBSession):
        return _duckdb(session, table)
    from .bigquery_session import BigQuerySession, table_parts

    if isinstance(session, BigQuerySession):
        return _bigquery(session, *table_parts(table))
    raise BatchLLMError(
        description=f"The cost estimate reads DuckDB and BigQuery output tables, not "
        f"{type(session).__name__}'s."
    )


def _duckdb(session: WarehouseSession, table: str) -> StoredAnswers | None:
    from .duckdb_names import describe, quoted

    conn = session.conn  # type: ignore[attr-defined]
    if not describe(conn, table).columns:
        return None
    n, mean = conn.execute(_SQL.format(table=quoted(table))).fetchone()
    return StoredAnswers(int(n), None if mean is None else float(mean))


def _bigquery(
    session: WarehouseSession, project: str | None, dataset: str, name: str
) -> StoredAnswers | None:
    from google.api_core.exceptions import NotFound
    from google.cloud import bigquery

    client = session.client  # type: ignore[attr-defined]
    ref = bigquery.DatasetReference(project or client.project, dataset).table(name)
    try:
        client.get_table(ref)
    except NotFound:
        return None
    sql = _SQL.format(table=f"`{ref.project}`.`{ref.dataset_id}`.`{ref.table_id}`")
    [(n, mean)] = [tuple(r.values()) for r in client.query(sql).result()]
    return StoredAnswers(int(n), None if mean is None else float(mean))
