"""The small interface a partition run needs from a warehouse, and safe identifiers.

Values always travel as query parameters; table and column names are checked against a strict
pattern and quoted, never pasted from config.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from typing import Any

from ..engine.errors import BatchLLMError

# Matched in full (`fullmatch`): `$` alone would also match before a trailing newline.
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# A Google Cloud project id: 6-30 lowercase letters, digits and hyphens, starting with a letter
# and not ending with a hyphen. Only this part of a table name may contain '-'.
PROJECT_ID = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")


class InvalidIdentifierError(BatchLLMError, ValueError):
    """A table or column name that could carry SQL: refused before anything runs."""


def check_identifier(name: str, what: str = "column") -> str:
    if not isinstance(name, str) or not _IDENT.fullmatch(name):
        raise InvalidIdentifierError(
            description=f"Invalid {what} name {name!r}: use letters, digits and underscores only "
            "(no quotes, backticks, semicolons, spaces or comments)."
        )
    return name


def check_table(name: str, *, max_parts: int = 3) -> tuple[str, ...]:
    """'table', 'schema.table' or 'catalog.schema.table' -> its checked parts."""
    parts = tuple(name.split(".")) if isinstance(name, str) else (name,)
    if not 1 <= len(parts) <= max_parts:
        raise InvalidIdentifierError(
            description=f"Invalid table name {name!r}: expected at most {max_parts} dotted parts."
        )
    for i, part in enumerate(parts):
        # A three-part name may start with a GCP project id, which has hyphens ("my-project").
        if i == 0 and len(parts) == 3 and isinstance(part, str) and PROJECT_ID.fullmatch(part):
            continue
        check_identifier(part, f"table name part of {name!r}:")
    return parts


class Columns(dict[str, str]):
    """Column name -> type, in the table's order and spelling, looked up ignoring case: DuckDB
    and BigQuery both match column names that way (`Headline` is the column `headline`)."""

    def _key(self, name: object) -> object:
        if dict.__contains__(self, name) or not isinstance(name, str):
            return name
        return next((k for k in self if k.lower() == name.lower()), name)

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, self._key(name))

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, self._key(name))  # type: ignore[call-overload]

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, self._key(name), default)  # type: ignore[call-overload]


@dataclass(frozen=True)
class SliceFilter:
    """Which rows of the source belong to one partition: a time window, one value, or all."""

    column: str | None = None
    start: datetime | None = None
    end: datetime | None = None
    value: Any = None
    label: str = "all"

    @property
    def kind(self) -> str:
        if self.column is None:
            return "all"
        return "range" if self.start is not None else "equals"


def utc_window(where: SliceFilter) -> tuple[datetime, datetime]:
    """The window's [start, end) as naive UTC datetimes (a naive bound is taken as UTC).

    Sent to the database as plain TIMESTAMP values, so neither the process's time zone nor the
    database session's can shift them.
    """
    if where.start is None or where.end is None:
        raise ValueError("utc_window needs a time-window slice")
    return _naive_utc(where.start), _naive_utc(where.end)


def _naive_utc(value: datetime) -> datetime:
    return (value.astimezone(UTC) if value.tzinfo else value).replace(tzinfo=None)


def utc_days(where: SliceFilter, table: str) -> tuple[date, date]:
    """The window as [first day, end day) for a DATE column, whose values are UTC days.

    A window that does not start and end at UTC midnight (hourly partitions, or partitions in
    another time zone) would cut a day in two: refused, naming the column and the window.
    """
    start, end = utc_window(where)
    if start.time() != time(0) or end.time() != time(0):
        raise BatchLLMError(
            description=f"Partition column {table!r}.{where.column} is a DATE (a UTC day), but "
            f"partition {where.label!r} covers [{start.isoformat()}Z, {end.isoformat()}Z), not "
            "whole UTC days. Use daily (or longer) partitions in UTC, or a TIMESTAMP column."
        )
    return start.date(), end.date()


# The output table's key: one row per source id per partition.
OUTPUT_KEY = ("partition_key", "id")


# The Batch API state table (issue 13): which rows went into which provider batch.
BATCH_STATE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("asset", "string"),
    ("partition_key", "string"),
    ("intent_id", "string"),  # ours, chosen before submitting: finds an orphan batch again
    ("file_id", "string"),
    ("batch_id", "string"),
    ("model", "string"),
    ("state", "string"),  # uploaded -> submitted -> collected
    ("provider_status", "string"),
    ("items", "string"),  # JSON {custom_id: [id, request_hash]}: the rows' request identities
    ("n_requests", "int"),
    ("tokens", "int"),  # estimated tokens enqueued (prompt + answer budget)
    ("created_at", "timestamp"),
    ("updated_at", "timestamp"),
)
BATCH_STATE_KEY = ("asset", "partition_key", "intent_id")


@dataclass(frozen=True)
class OutputTable:
    """Where results go: the table and its columns after `id` as (name, logical type), the
    logical types being string, int, float and timestamp. The assets layer owns the schema."""

    name: str
    columns: tuple[tuple[str, str], ...]

    @property
    def names(self) -> list[str]:
        return ["id", *(c for c, _ in self.columns)]


@dataclass(frozen=True)
class SourceRef:
    table: str
    id_column: str
    columns: tuple[str, ...]
    partition_column: str | None = None


class LeaseStore(abc.ABC):
    """Where partition leases live when runs on several hosts must see them: a shared Redis, or
    the warehouse itself. A lease is a name -> holder entry that lapses `ttl_s` after its last
    claim; its holder claims it again every `ttl_s / renewals` seconds."""

    where: str = "the lease store"  # for messages: which server or table (never a password)
    ttl_s: float

    @abc.abstractmethod
    def claim(self, name: str, holder: str, *, replacing: str | None = None) -> str | None:
        """Take or renew the lease for `holder`, atomically, if it is free, lapsed, already
        `holder`'s or `replacing`'s (a holder known to be dead): None. Else the holder's value,
        unchanged."""

    @abc.abstractmethod
    def release(self, name: str, holder: str) -> None:
        """Give the lease up if `holder` still holds it."""

    def transient(self, exc: BaseException) -> bool:
        """Whether an error of `claim` is an outage worth waiting out (else: a clear error)."""
        return False

    def close(self) -> None:  # noqa: B027 (most stores have nothing of their own to close)
        """Free the store's own connections."""


class WarehouseSession(abc.ABC):
    """One connection's worth of the operations a partition run needs."""

    write_interval_s: float = 1.0
    """Minimum seconds between two writes of one partition run. The pipeline's writer gathers
    answers for at least this long before it calls write_results, so a run issues about one
    data-changing statement per interval whatever the answer rate (BigQuery: a few seconds, as
    each MERGE is a job of its own; DuckDB: 1 s)."""

    reads_on_loop: bool = False
    """An embedded database answers a chunk read or lookup in milliseconds: the partition run
    then reads on its event loop, which costs less than a reader thread contending with the
    loop for the GIL (measured: 0.56 against 0.82 of the bare engine's rows/s). A remote one
    (BigQuery: a query is a job of seconds) reads in a thread."""

    def lease_store(self, output: str) -> LeaseStore | None:
        """Where this warehouse keeps the partition leases of `output` when there is no shared
        Redis: a store every host sees, or None when a local file lock is enough (an embedded
        database is used from one host)."""
        return None

    @abc.abstractmethod
    def check_source(self, source: SourceRef) -> None:
        """Raise a clear error if the table or any named column does not exist."""

    @abc.abstractmethod
    def slice_stats(self, source: SourceRef, where: SliceFilter) -> tuple[int, list[Any], int]:
        """(rows, up to 5 duplicate ids, ids that cannot key a row) of the slice.

        The last count is of NULL ids and, for floating-point id columns, NaN and infinite ones.
        """

    @abc.abstractmethod
    def read_slice(
        self, source: SourceRef, where: SliceFilter, chunk_rows: int
    ) -> Iterator[list[dict[str, Any]]]:
        """The slice's rows (id + columns), in chunks of at most chunk_rows, ordered by id."""

    @abc.abstractmethod
    def ensure_output(self, output: OutputTable, source: SourceRef) -> None:
        """Create the output table if missing, with the source id's type, keyed by OUTPUT_KEY.

        An existing table gains the output schema's new columns (nullable); one keyed by id
        alone (the older layout) is migrated or refused with how to migrate; a column whose type
        changed is refused, naming it and both types."""

    @abc.abstractmethod
    def done_hashes(
        self, output: OutputTable, partition_key: str, ids: Sequence[Any]
    ) -> dict[Any, str]:
        """request_hash of the rows of this partition among `ids` that already succeeded."""

    @abc.abstractmethod
    def stored_answers(
        self, output: OutputTable, hashes: Sequence[str], partition_key: str, *, everywhere: bool
    ) -> dict[str, dict[str, Any]]:
        """request_hash -> one row (every output column) stored `ok` under it, in
        `partition_key` or, when `everywhere`, in any partition; a row that paid for its answer
        (shared_from NULL) rather than one that shared it. A query per few thousand hashes, on
        the table's request_hash index (DuckDB) or clustering (BigQuery)."""

    @abc.abstractmethod
    def write_results(self, output: OutputTable, rows: list[dict[str, Any]]) -> None:
        """Upsert by (partition_key, id): after it, each key has exactly one row. Each
        statement is atomic; of two rows with the same key in `rows`, the last one wins."""

    @abc.abstractmethod
    def count_output(self, table: str, partition_key: str) -> int:
        """Output rows of one partition."""

    def has_output(self, table: str, partition_key: str) -> bool:
        """Whether a partition has output rows. Its first run (the common case) has none and
        so nothing to skip: readers then spare the warehouse a lookup per chunk (a query each
        on BigQuery)."""
        return self.count_output(table, partition_key) > 0

    @abc.abstractmethod
    def list_tables(self, dataset: str, limit: int) -> list[str]:
        """Up to `limit` table names of a dataset (schema), sorted; an error if it is missing."""

    @abc.abstractmethod
    def partition_summary(self, output: str, partition_key: str) -> dict[str, Any]:
        """The partition as the output table holds it: rows_ok, rows_failed, rows_total,
        prompt_tokens, completion_tokens, cost_usd (None when a priced row has no cost) and
        errors (the top error classes -> rows)."""

    # -- Batch API state (issue 13): one row per submitted input file ------------------------
    def ensure_batch_state(self, table: str) -> None:
        """Create the batch state table (BATCH_STATE_COLUMNS, keyed by BATCH_STATE_KEY)."""
        raise NotImplementedError(f"{type(self).__name__} does not support batch mode")

    def put_batch_state(self, table: str, record: dict[str, Any]) -> None:
        """Upsert one state row by BATCH_STATE_KEY, durably (committed when this returns)."""
        raise NotImplementedError(f"{type(self).__name__} does not support batch mode")

    def batch_states(
        self, table: str, asset: str, partition_key: str | None = None, *, open_only: bool = False
    ) -> list[dict[str, Any]]:
        """State rows of an asset (one partition, or all when None), oldest first; [] if the
        table does not exist yet. `open_only`: only rows in state uploaded or submitted."""
        raise NotImplementedError(f"{type(self).__name__} does not support batch mode")

    def list_tables_page(self, dataset: str, after: str | None, limit: int) -> list[str]:
        """Up to `limit` table names sorted after `after` (None: from the first): one page of a
        listing of any length. This default reads the whole listing; sessions override it."""
        names = self.list_tables(dataset, 2**31 - 1)
        return [n for n in names if after is None or n > after][: max(0, limit)]


SUMMARY_TOP_ERRORS = 5
# Failed rows listed on each materialization: enough to see the pattern, small enough for the UI.
FAILED_ROWS_SAMPLE = 20
_UNPRICED = "SUM(CASE WHEN cost_usd IS NULL AND prompt_tokens IS NOT NULL THEN 1 ELSE 0 END)"


def partition_summary_sql(table_sql: str, param: str) -> tuple[str, str, str, str]:
    """(totals, top errors, failed-row sample, asset cost to date) queries of one partition, in
    SQL both DuckDB and BigQuery run; `param` is the dialect's placeholder for the partition
    key (the last query takes none: it sums every partition)."""
    totals = (
        "SELECT SUM(CASE WHEN status = 'ok' THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN status = 'ok' THEN 0 ELSE 1 END), COUNT(*), "
        f"SUM(prompt_tokens), SUM(completion_tokens), SUM(cost_usd), {_UNPRICED} "
        f"FROM {table_sql} WHERE partition_key = {param}"
    )
    errors = (
        f"SELECT error_class, COUNT(*) AS n FROM {table_sql} "
        f"WHERE partition_key = {param} AND status <> 'ok' "
        f"GROUP BY error_class ORDER BY n DESC, error_class LIMIT {SUMMARY_TOP_ERRORS}"
    )
    return (
        totals,
        errors,
        failed_rows_sql(table_sql, param, FAILED_ROWS_SAMPLE),
        (f"SELECT SUM(cost_usd), {_UNPRICED} FROM {table_sql}"),
    )


def failed_rows_sql(table_sql: str, param: str, limit: int | None = None) -> str:
    """The failed rows of one partition (all of them without `limit`): the query shown on each
    materialization, to copy, is this one."""
    return (
        f"SELECT id, error_class, error, attempts FROM {table_sql} "
        f"WHERE partition_key = {param} AND status <> 'ok' ORDER BY id"
        + (f" LIMIT {limit}" if limit is not None else "")
    )


def partition_summary_dict(
    totals: Sequence[Any],
    errors: Sequence[Sequence[Any]],
    failed: Sequence[Sequence[Any]] = (),
    to_date: Sequence[Any] | None = None,
) -> dict[str, Any]:
    ok, failed_n, total, prompt, completion, cost, unpriced = totals
    summary = {
        "rows_ok": int(ok or 0),
        "rows_failed": int(failed_n or 0),
        "rows_total": int(total or 0),
        "prompt_tokens": int(prompt or 0),
        "completion_tokens": int(completion or 0),
        "cost_usd": None if unpriced else float(cost or 0.0),
        "errors": {str(cls or "unknown"): int(n) for cls, n in errors},
        "failed_rows": [
            {"id": str(i), "error_class": c or "unknown", "error": e or "", "attempts": int(a or 0)}
            for i, c, e, a in failed
        ],
    }
    if to_date is not None:  # the asset's cost over every partition (None: some unpriced)
        summary["asset_cost_usd"] = None if to_date[1] else float(to_date[0] or 0.0)
    return summary


class Warehouse(abc.ABC):
    """A resource that can open a WarehouseSession."""

    @abc.abstractmethod
    def session(self) -> AbstractContextManager[WarehouseSession]: ...

    def identity(self) -> str:
        """Which warehouse this is (a file, a project): keeps local journals apart."""
        return type(self).__name__
