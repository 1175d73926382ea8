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
from datetime import datetime
from typing import Any

from ..engine.errors import BatchLLMError

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")


class InvalidIdentifierError(BatchLLMError, ValueError):
    """A table or column name that could carry SQL: refused before anything runs."""


def check_identifier(name: str, what: str = "column") -> str:
    if not isinstance(name, str) or not _IDENT.match(name):
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
        if i == 0 and len(parts) == 3 and isinstance(part, str) and _PROJECT.match(part):
            continue
        check_identifier(part, f"table name part of {name!r}:")
    return parts


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


class WarehouseSession(abc.ABC):
    """One connection's worth of the operations a partition run needs."""

    @abc.abstractmethod
    def check_source(self, source: SourceRef) -> None:
        """Raise a clear error if the table or any named column does not exist."""

    @abc.abstractmethod
    def slice_stats(self, source: SourceRef, where: SliceFilter) -> tuple[int, list[Any], int]:
        """(rows, up to 5 duplicate ids, NULL ids) of the slice."""

    @abc.abstractmethod
    def read_slice(
        self, source: SourceRef, where: SliceFilter, chunk_rows: int
    ) -> Iterator[list[dict[str, Any]]]:
        """The slice's rows (id + columns), in chunks of at most chunk_rows, ordered by id."""

    @abc.abstractmethod
    def ensure_output(self, output: OutputTable, source: SourceRef) -> None:
        """Create the output table if missing, with the source id's type."""

    @abc.abstractmethod
    def done_hashes(
        self, output: OutputTable, partition_key: str, ids: Sequence[Any]
    ) -> dict[Any, str]:
        """request_hash of the rows of this partition among `ids` that already succeeded."""

    @abc.abstractmethod
    def write_results(self, output: OutputTable, rows: list[dict[str, Any]]) -> None:
        """Upsert by id, atomically: after it, each id has exactly one row."""

    @abc.abstractmethod
    def count_output(self, table: str, partition_key: str) -> int:
        """Output rows of one partition."""

    @abc.abstractmethod
    def list_tables(self, dataset: str, limit: int) -> list[str]:
        """Up to `limit` table names of a dataset (schema), sorted; an error if it is missing."""

    def list_tables_page(self, dataset: str, after: str | None, limit: int) -> list[str]:
        """Up to `limit` table names sorted after `after` (None: from the first): one page of a
        listing of any length. This default reads the whole listing; sessions override it."""
        names = self.list_tables(dataset, 2**31 - 1)
        return [n for n in names if after is None or n > after][: max(0, limit)]


class Warehouse(abc.ABC):
    """A resource that can open a WarehouseSession."""

    @abc.abstractmethod
    def session(self) -> AbstractContextManager[WarehouseSession]: ...

    def identity(self) -> str:
        """Which warehouse this is (a file, a project): keeps local journals apart."""
        return type(self).__name__
