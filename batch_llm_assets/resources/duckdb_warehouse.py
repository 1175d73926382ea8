"""The embedded warehouse as a Dagster resource: DuckDB, on dagster-duckdb's DuckDBResource."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from dagster_duckdb import DuckDBResource

from ..warehouses.base import Warehouse
from ..warehouses.duckdb_session import DuckDBSession


class DuckDBWarehouse(DuckDBResource, Warehouse):
    """DuckDB as the batch asset's warehouse: one file, one writer at a time."""

    def identity(self) -> str:
        return f"duckdb:{os.path.abspath(self.database)}"

    @contextlib.contextmanager
    def session(self) -> Iterator[DuckDBSession]:
        with self.get_connection() as conn:
            try:
                yield DuckDBSession(conn)
            finally:
                conn.close()  # get_connection does not close it when the body raises
