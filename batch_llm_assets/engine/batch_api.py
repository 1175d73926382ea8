"""An async client for a provider's Batch API (/v1/files + /v1/batches), and its JSONL.

Plain aiohttp, no Dagster. OpenAI's URL form, or Azure OpenAI's when `api_version` is set
({endpoint}/openai/files?api-version=..., key in the api-key header). Output lines are read with
the live path's `parse_completion`, so a batch answer and a live answer become the same record.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from .errors import (
    CONNECTION_ERROR,
    SERVER_ERROR,
    BatchLLMError,
    ProviderError,
    redact,
)
from .requests import backoff_delay
from .transport import ChatResponse, error_from_body, parse_completion

CHAT_ENDPOINT = "/v1/chat/completions"
# The batch's metadata key naming its endpoint when it is not CHAT_ENDPOINT (one endpoint per
# batch: the OpenAI batches reference, `endpoint`).
ENDPOINT_TAG = "bla_endpoint"
COMPLETION_WINDOW = "24h"
DEFAULT_MAX_FILE_REQUESTS = 50_000
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_ATTEMPTS = 5  # of an idempotent call
LIST_PAGE = 100  # batches per list call (OpenAI's maximum)
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# Line errors that mean "never processed": the request goes back to pending, it did not fail.
NOT_PROCESSED = frozenset({"batch_expired", "batch_cancelled"})


class BatchAPIError(BatchLLMError):
    """A files or batches call the provider refused or that could not reach it."""


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch input file."""

    custom_id: str
    body: dict[str, Any]
    tokens: int = 0  # estimated: prompt + answer budget, for the enqueued-token limit
    url: str = CHAT_ENDPOINT

    def encode(self) -> bytes:
        record = {"custom_id": self.custom_id, "method": "POST", "url": self.url}
        return json.dumps(record | {"body": self.body}, separators=(",", ":")).encode() + b"\n"


def split_files(
    lines: Iterable[BatchLine],
    *,
    max_requests: int = DEFAULT_MAX_FILE_REQUESTS,
    max_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_tokens: int | None = None,
) -> Iterator[list[tuple[BatchLine, bytes]]]:
    """Group lines into input files within the per-file request and byte limits (and, when
    given, a token budget, so that no file alone exceeds an enqueued-token limit)."""
    group: list[tuple[BatchLine, bytes]] = []
    size = tokens = 0
    for line in lines:
        data = line.encode()
        if len(data) > max_bytes:
            raise BatchAPIError(
                description=f"request {line.custom_id} is {len(data)} bytes, over the "
                f"per-file limit of {max_bytes} bytes"
            )
        over_tokens = max_tokens is not None and tokens + line.tokens > max_tokens
        if group and (len(group) >= max_requests or size + len(data) > max_bytes or over_tokens):
            yield group
            group, size, tokens = [], 0, 0
        group.append((line, data))
        size += len(data)
        tokens += line.tokens
    if group:
        yield group


@dataclass(frozen=True, slots=True)
class LineResult:
    """One output or error line: an answer, a failure (class + reason), or not processed."""

    custom_id: str
    response: ChatResponse | None = None
    error_class: str | None = None
    error_message: str | None = None
    processed: bool = True


def parse_output_line(
    record: dict[str, Any], secret: str = "", parse: Any = parse_completion
) -> LineResult:
    """A line of an output or error file as the live path would have seen the same answer
    (`parse`: the answer's body -> its record, a chat completion's by default)."""
    custom_id = str(record.get("custom_id"))
    error = record.get("error")
    response = record.get("response")
    if error and not response:
        code = str(error.get("code") or "batch_error")
        if code in NOT_PROCESSED:
            return LineResult(custom_id, processed=False)
        message = redact(str(error.get("message") or code), secret)
        return LineResult(custom_id, error_class=SERVER_ERROR, error_message=message)
    status = int((response or {}).get("status_code") or 0)
    body = (response or {}).get("body")
    if status != 200:
        failure = error_from_body(status, json.dumps(body), {}, secret)
        return LineResult(custom_id, error_class=failure.error_class, error_message=failure.message)
    try:
        return LineResult(custom_id, response=parse(body, {}))
    except ProviderError as exc:
        return LineResult(custom_id, error_class=exc.error_class, error_message=exc.message)


class BatchClient:
    """Files and batches over one aiohttp session; use as `async with BatchClient(...) as c`."""

    def __init__(
        self, *, base_url: str, api_key: str, api_version: str | None = None, timeout_s: float = 120
    ) -> None:
        self._secret = api_key
        base = base_url.rstrip("/")
        if api_version:
            self._root = f"{base}/openai"
            self._params: dict[str, str] = {"api-version": api_version}
            self._headers = {"api-key": api_key}
        else:
            self._root = base
            self._params = {}
            self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> BatchClient:
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, *, raw: bool = False, **kw: Any) -> Any:
        """One call; reads (and uploads, which at worst leave an unused file) are retried on
        connection errors, 429 and 5xx. Creating a batch is not: a retry could submit twice, so
        the caller's recovery (find by metadata) decides instead."""
        retry = method == "GET" or path == "/files"
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return await self._once(method, path, raw=raw, **kw)
            except BatchAPIError as exc:
                if not (retry and exc.metadata.get("retryable")) or attempt == MAX_ATTEMPTS:
                    raise
                await asyncio.sleep(backoff_delay(attempt, exc.metadata.get("retry_after_s")))
        raise AssertionError("unreachable")

    async def _once(self, method: str, path: str, *, raw: bool, **kw: Any) -> Any:
        if self._session is None:
            raise RuntimeError("BatchClient used outside `async with`")
        params = {**self._params, **kw.pop("params", {})}
        try:
            async with self._session.request(
                method, self._root + path, params=params, **kw
            ) as resp:
                data = await resp.read()
                status = resp.status
                headers = {k.lower(): v for k, v in resp.headers.items()}
        except (aiohttp.ClientError, TimeoutError) as exc:
            message = redact(f"{type(exc).__name__}: {exc}", self._secret)
            raise BatchAPIError(
                description=f"{method} {path}: {message}",
                metadata={"error_class": CONNECTION_ERROR, "retryable": True},
            ) from None
        if status >= 400:
            failure = error_from_body(
                status, data.decode("utf-8", "replace"), headers, self._secret
            )
            raise BatchAPIError(
                description=f"{method} {path}: {failure.message}",
                metadata={
                    "error_class": failure.error_class,
                    "status": status,
                    "retryable": failure.retryable,
                    **({"retry_after_s": failure.retry_after_s} if failure.retry_after_s else {}),
                },
            )
        return data if raw else json.loads(data)

    async def upload(self, content: bytes, filename: str = "batch.jsonl") -> str:
        """POST /files (multipart, purpose=batch): the new file's id."""
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename=filename, content_type="application/jsonl")
        return (await self._call("POST", "/files", data=form))["id"]

    async def create(self, input_file_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        body = {
            "input_file_id": input_file_id,
            "endpoint": metadata.get(ENDPOINT_TAG, CHAT_ENDPOINT),
            "completion_window": COMPLETION_WINDOW,
            "metadata": metadata,
        }
        return await self._call("POST", "/batches", json=body)

    async def retrieve(self, batch_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/batches/{batch_id}")

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        return await self._call("POST", f"/batches/{batch_id}/cancel")

    async def file_created_at(self, file_id: str) -> float | None:
        """When the provider received the file (its clock), or None if it cannot say."""
        try:
            info = await self._call("GET", f"/files/{file_id}")
        except BatchAPIError as exc:
            if exc.metadata.get("retryable"):
                raise
            return None  # gone, or a provider without this route: the whole list is read
        created = info.get("created_at")
        return float(created) if isinstance(created, int | float) else None

    async def find(
        self, *, tag: tuple[str, str], input_file_id: str, not_before: float | None
    ) -> dict[str, Any] | None:
        """The batch created from `input_file_id` or carrying metadata[tag[0]] == tag[1], or
        None. The list is newest first, so the search ends at the first batch created before
        `not_before` (the input file's upload, in the provider's clock: a batch of it cannot be
        older), however many newer batches the key has; without it, at the end of the list."""
        key, value = tag
        after: str | None = None
        while True:
            params = {"limit": str(LIST_PAGE), **({"after": after} if after else {})}
            page = await self._call("GET", "/batches", params=params)
            data = [b for b in page.get("data") or [] if isinstance(b, dict)]
            for batch in data:
                meta = batch.get("metadata")
                if batch.get("input_file_id") == input_file_id or (
                    isinstance(meta, dict) and meta.get(key) == value
                ):
                    return batch
            oldest = data[-1].get("created_at") if data else None
            if not_before is not None and isinstance(oldest, int | float) and oldest < not_before:
                return None
            if not page.get("has_more") or not data or page.get("last_id") in (None, after):
                return None
            after = page.get("last_id")

    async def lines(self, file_id: str | None) -> list[dict[str, Any]]:
        """The records of an output or error file ([] for none)."""
        if not file_id:
            return []
        data = await self._call("GET", f"/files/{file_id}/content", raw=True)
        return [json.loads(line) for line in data.splitlines() if line.strip()]
