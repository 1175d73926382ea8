"""The partition run's reader: chunks of the slice -> skip-done lookup -> render -> requests.

Where it runs is chosen for throughput: an embedded warehouse (DuckDB answers a chunk in
milliseconds) with a plain template reads and renders on the event loop, as the engine's workers
pull requests; anything else reads in a daemon thread a bounded number of chunks ahead (a remote
query is a job of seconds; a Jinja template renders there, off the loop, within its limits).
A reader thread contending with the loop for the GIL cost more than the reads it moved: 0.56
against 0.82 of the bare engine's rows/s (benchmarks/partition_throughput.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from ..engine.engine import ChatRequest, Engine
from ..engine.identity import MessagesIdentity, request_identity
from ..engine.structured import provider_kind, validator
from ..warehouses.base import SliceFilter, WarehouseSession
from .template_breaker import TemplateBreaker

if TYPE_CHECKING:
    from ..resources.llm import LLMResource
    from .pipeline import RunSpec, RunStats

READ_AHEAD_CHUNKS = 2


class _ReaderFailed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Stopped(Exception):
    pass


_END = object()


class SliceReader:
    """The requests of one partition run, with each row's request identity in `hashes`."""

    def __init__(
        self,
        spec: RunSpec,
        llm: LLMResource,
        session: WarehouseSession,
        where: SliceFilter,
        partition_key: str,
        stats: RunStats,
        max_prompt_chars: int | None,
    ) -> None:
        self.spec = spec
        self.llm = llm
        self.db = session
        self.where = where
        self.partition_key = partition_key
        self.stats = stats
        self.max_prompt_chars = max_prompt_chars
        self.typed = spec.output_schema
        self.hashes: dict[Any, str] = {}  # id -> request identity, taken by the row's answer
        self.nothing_done = False  # set by preflight: no output rows yet, so no lookups
        self._engine: Engine | None = None
        self.scopes = spec.identity_scopes(llm)
        self.template = TemplateBreaker()
        self._identities: dict[tuple[str, int], MessagesIdentity] = {}
        self._stop = threading.Event()
        # Typed outputs: the provider's form of structured output (known for sure once the
        # engine is open: a self-hosted server is asked then).
        self.provider_kind = provider_kind(
            llm.base_url, api_version=llm.api_version, provider=getattr(llm, "provider", None)
        )

    def stop(self) -> None:
        self._stop.set()

    async def chunks(self, engine: Engine) -> AsyncIterator[list[ChatRequest]]:
        """The slice's requests for `engine` (whose exact bodies are hashed), a chunk at a
        time, in id order."""
        self._engine = engine
        self.provider_kind = getattr(self.llm, "structured_kind", self.provider_kind)
        if self.spec.prompt.plain and self.db.reads_on_loop:
            chunks = self.db.read_slice(self.spec.source, self.where, self.spec.chunk_rows)
            with contextlib.closing(chunks):
                for chunk in chunks:
                    # A chunk at a time, not a row per pull: in one tight loop the rendering
                    # and hashing run at their micro-benchmark cost, interleaved with the
                    # workers' sends at about three times that (measured; caches stay warm).
                    yield list(self._render(chunk, self._done(chunk)))
                    if self.template.error is not None:
                        raise self.template.error
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()  # bounded by `slots`, taken by the reader
        slots = threading.Semaphore(READ_AHEAD_CHUNKS)
        loop = asyncio.get_running_loop()
        # A daemon thread, not the default executor: a run that is stopping never waits for it.
        reader = threading.Thread(target=self._read, args=(loop, queue, slots), daemon=True)
        reader.start()
        try:
            while True:
                batch = await queue.get()
                slots.release()
                if batch is _END:
                    return
                if isinstance(batch, _ReaderFailed):
                    raise batch.exc
                here = isinstance(batch, tuple)  # a plain template: rendered on the loop
                yield list(self._render(*batch)) if here else batch
                if here and self.template.error is not None:
                    raise self.template.error
        finally:
            self._stop.set()

    # -- the reader thread -------------------------------------------------------------------
    def _read(
        self,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[Any],
        slots: threading.Semaphore,
    ) -> None:
        """Chunks of the slice -> skip done rows -> render; off the event loop, bounded ahead."""

        def put(item: Any) -> None:
            while not slots.acquire(timeout=0.2):
                if self._stop.is_set():
                    raise _Stopped
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the run's loop is closed: it ended without us
                raise _Stopped from None

        src = self.spec.source
        plain = self.spec.prompt.plain
        try:
            chunks = self.db.read_slice(src, self.where, self.spec.chunk_rows)
            with contextlib.closing(chunks):
                for chunk in chunks:
                    if self._stop.is_set():
                        return
                    done = self._done(chunk)
                    # A plain template renders on the event loop as rows are pulled (no GIL
                    # contention with this thread); any other one here, off the loop.
                    put((chunk, done) if plain else list(self._render(chunk, done)))
                    if not plain and self.template.error is not None:
                        put(_ReaderFailed(self.template.error))  # after the rows failed so far
                        return
            put(_END)
        except _Stopped:
            return
        except BaseException as exc:  # handed to the event loop, raised there
            with contextlib.suppress(_Stopped):
                put(_ReaderFailed(exc))

    def _done(self, chunk: list[dict[str, Any]]) -> dict[Any, str]:
        if self.nothing_done:
            return {}
        ids = [r[self.spec.source.id_column] for r in chunk]
        return self.db.done_hashes(self.spec.output, self.partition_key, ids)

    # -- render ------------------------------------------------------------------------------
    def _render(self, chunk: list[dict[str, Any]], done: dict[Any, str]) -> Iterator[Any]:
        """Each row's request (`_request`), or its failure when the template cannot render it;
        rows already done under the same identity are skipped (None)."""
        id_column = self.spec.source.id_column
        for row in chunk:
            if self._stop.is_set():
                raise _Stopped
            rid = row[id_column]
            messages, problem = self.spec.prompt.render(row, max_chars=self.max_prompt_chars)
            if problem is not None:
                yield self._unsent(rid, (problem[0], f"{problem[1]}; not sent"))
                if self.template.observe(*problem):  # in row order, as rendered
                    return  # the rows failed so far are kept; the caller raises the error
                continue
            self.template.observe(None, None)
            item = self._request(rid, messages, done)
            if item is not None:
                yield item

    def _unsent(self, rid: Any, error: tuple[str, str]) -> Any:
        return ChatRequest(rid, None, error=error)

    def _request(
        self, rid: Any, messages: list[dict[str, Any]], done: dict[Any, str]
    ) -> ChatRequest | None:
        """The row's chat request, or None when it is done under the same identity."""
        assert self._engine is not None
        rendered = messages
        params, messages = (
            self.typed.shape(self.provider_kind, messages) if self.typed else (None, messages)
        )
        # Built once: the same dict is sent (ChatRequest.body). A typed row's identity is
        # what is asked (the rendered messages, the schema), not the provider's form of it.
        body = None if params is None else self._engine.request_body(messages, params)
        key = (
            body if self.typed is None else self._engine.request_body(rendered, self.typed.identity)
        )
        h = self._hash(messages, key, 0)
        stored = done.get(rid)
        if stored is not None and self._is_done(stored, h, messages, key, body):
            self.stats.skipped += 1
            return None
        self.hashes[rid] = h
        if self.typed is None:
            return ChatRequest(rid, messages)
        return ChatRequest(
            rid,
            messages,
            params=params,
            validate=validator(self.typed.parse),
            repair_attempts=self.spec.repair_attempts,
            body=body,
        )

    def _is_done(
        self,
        stored: str,
        h: str,
        messages: list[dict[str, Any]],
        key: dict[str, Any] | None,
        body: dict[str, Any] | None,
    ) -> bool:
        """Whether a stored ok row's hash is this request's: its identity, in the earlier
        scope too, or for a typed row the exact body sent (its identity before it left out
        the provider's form: rows stored then are done as well)."""
        if stored in (h, self._hash(messages, key, 1)):
            return True
        return body is not None and stored == request_identity(body, self.scopes[0])

    def _hash(
        self, messages: list[dict[str, Any]], body: dict[str, Any] | None, legacy: int
    ) -> str:
        """request_identity of the body sent for these messages (`body`, when the row has params
        of its own), in `scopes[legacy]`. Without, the rest of the body is the same for every
        row while the engine keeps its token parameter: it is encoded once."""
        engine = self._engine
        assert engine is not None
        if body is not None:
            return request_identity(body, self.scopes[legacy])
        key = (engine.token_param.name, legacy)
        identity = self._identities.get(key)
        if identity is None:
            body = engine.request_body([])
            del body["messages"]
            identity = self._identities[key] = MessagesIdentity(body, self.scopes[legacy])
        return identity(messages, text_only=True)  # rendered: role and content
