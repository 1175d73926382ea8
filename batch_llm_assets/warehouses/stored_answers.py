"""The stored-answers lookup: for a chunk's request identities, one answer stored `ok` under
each (assets/sharing.py reuses it instead of sending the request again), in SQL per dialect.

Of the rows stored under an identity, the one returned is a row that paid for its answer
(shared_from NULL) when there is one, then the first by (partition_key, id): the same row
whichever run asks.
"""

from __future__ import annotations

from collections.abc import Callable

# Hashes per DuckDB query: its default index_scan_max_count (an IN list longer than this is
# joined by a scan, not looked up in the index).
DUCKDB_MAX_HASHES = 2048
# Hashes per BigQuery query (one ARRAY parameter; far below the 10 MB request limit).
BIGQUERY_MAX_HASHES = 10_000


def duckdb_index_sql(table: str, q: Callable[[str], str], qt: Callable[[str], str]) -> str:
    """An ART index on request_hash, named after the table, in its schema (created once)."""
    name = table.split(".")[-1][:100] + "__request_hash"
    return f"CREATE INDEX IF NOT EXISTS {q(name)} ON {qt(table)} (request_hash)"


def duckdb_sql(
    table_sql: str, names: list[str], n: int, q: Callable[[str], str], *, here: bool
) -> str:
    """`n` hashes as `?` (after the partition key when `here`: this partition only; the key is
    passed again at the end). DuckDB scans the request_hash index only when the IN list is
    the scan's one filter, so status and partition are decided by the ranking, after it."""
    cols = ", ".join(q(c) for c in names)
    first = "partition_key <> ?, " if here else ""
    return (
        f"SELECT {cols} FROM (SELECT {cols}, row_number() OVER (PARTITION BY request_hash "
        f"ORDER BY status <> 'ok', {first}shared_from IS NOT NULL, partition_key, id) AS _bla_rank "
        f"FROM {table_sql} WHERE request_hash IN ({', '.join('?' for _ in range(n))})) "
        "WHERE _bla_rank = 1 AND status = 'ok'" + (" AND partition_key = ?" if here else "")
    )


def bigquery_sql(table_sql: str, names: list[str], q: Callable[[str], str], *, here: bool) -> str:
    """@hashes (ARRAY<STRING>), and @pk when `here`. In the WHERE clause, the partition and the
    hashes prune the blocks of a table clustered by (partition_key, request_hash, ...)."""
    cols = ", ".join(q(c) for c in names)
    return (
        f"SELECT {cols} FROM (SELECT {cols}, ROW_NUMBER() OVER (PARTITION BY `request_hash` "
        "ORDER BY IF(`shared_from` IS NULL, 0, 1), `partition_key`, `id`) AS _bla_rank "
        f"FROM {table_sql} WHERE `request_hash` IN UNNEST(@hashes) AND `status` = 'ok'"
        + (" AND `partition_key` = @pk" if here else "")
        + ") WHERE _bla_rank = 1"
    )
