"""BigQuery as the batch asset's warehouse: a Dagster resource on dagster-gcp's BigQueryResource.

The SQL lives in `batch_llm_assets.warehouses.bigquery_session`; this module owns the client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dagster_gcp import BigQueryResource
from dagster_gcp.bigquery.utils import setup_gcp_creds
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery
from pydantic import Field

from ..engine.errors import BatchLLMError
from ..warehouses.base import Warehouse
from ..warehouses.bigquery_session import BigQuerySession


class BigQueryWarehouse(BigQueryResource, Warehouse):
    """BigQuery as the batch asset's warehouse.

    Project, location and credentials are BigQueryResource's fields; `api_endpoint` points the
    client at an emulator or a private endpoint.
    """

    api_endpoint: str | None = Field(
        default=None,
        description=(
            "Base URL of the BigQuery API to use instead of Google's, e.g. a local emulator "
            "(http://127.0.0.1:9050) or a private endpoint. With it, and without "
            "gcp_credentials, the client sends no credentials (AnonymousCredentials); `project` "
            "is then required."
        ),
    )

    write_interval_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "Minimum seconds between two writes (MERGE statements) of one partition run. Each "
            "MERGE is a BigQuery job of a few seconds, and BigQuery runs two mutating DML "
            "statements per table at a time (20 more queue): with many partitions running at "
            "once on one output table, a longer interval keeps them within that limit."
        ),
    )

    @contextlib.contextmanager
    def get_client(self) -> Iterator[bigquery.Client]:
        if self.api_endpoint is None:
            with super().get_client() as client:
                yield client
            return
        if not self.project:
            raise BatchLLMError(
                description="BigQueryWarehouse: set `project` when `api_endpoint` is set."
            )
        options = ClientOptions(api_endpoint=self.api_endpoint)
        if self.gcp_credentials:
            with setup_gcp_creds(self.gcp_credentials):
                yield bigquery.Client(
                    project=self.project, location=self.location, client_options=options
                )
            return
        yield bigquery.Client(
            project=self.project,
            location=self.location,
            credentials=AnonymousCredentials(),
            client_options=options,
        )

    def identity(self) -> str:
        endpoint = self.api_endpoint or "bigquery.googleapis.com"
        return f"bigquery:{endpoint}:{self.project or '(default project)'}"

    def get_object_to_set_on_execution_context(self) -> Any:
        # BigQueryResource hands ops a bare client; the batch asset needs the resource itself.
        return self

    @contextlib.contextmanager
    def session(self) -> Iterator[BigQuerySession]:
        with self.get_client() as client:
            try:
                yield BigQuerySession(client, write_interval_s=self.write_interval_s)
            finally:
                client.close()
