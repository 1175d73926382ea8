"""The embedded warehouse as a Dagster resource: DuckDB, on dagster-duckdb's DuckDBResource."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import duckdb
from dagster_duckdb import DuckDBResource

from ..engine.errors import BatchLLMError
from ..warehouses.base import Warehouse
from ..warehouses.duckdb_session import DuckDBSession


class DuckDBWarehouse(DuckDBResource, Warehouse):
    """DuckDB as the batch asset's warehouse: one file, one writer at a time."""

    def identity(self) -> str:
        return f"duckdb:{os.path.abspath(self.database)}"

    @contextlib.contextmanager
    def session(self) -> Iterator[DuckDBSession]:
        """A session whose connection opens at its first use (after the partition's lease)."""
        with contextlib.ExitStack() as stack:

            def connect() -> duckdb.DuckDBPyConnection:
                try:
                    conn = stack.enter_context(self.get_connection())
                except duckdb.Error as exc:
                    raise BatchLLMError(
                        description=f"Could not open DuckDB file {self.database!r}: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. "
                        "DuckDB takes one writing process per file: give the assets on this "
                        "file one concurrency pool with a limit of 1 (docs/deployment.md), so "
                        "their runs queue instead."
                    ) from None
                stack.callback(conn.close)  # get_connection does not close it on an error
                return conn

            yield DuckDBSession(connect)
