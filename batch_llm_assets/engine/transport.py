"""HTTP transports for chat completions: a lean aiohttp path and the openai SDK.

Both return a `ChatResponse` or raise `ProviderError`, so the engine above them is the same.
The aiohttp path exists because the SDK's per-request cost (httpx, pydantic models) dominates
at hundreds of requests per second on a small machine (see docs/benchmarks.md).
"""

from __future__ import annotations

import email.utils
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from . import _constants as C
from .errors import (
    CONNECTION_ERROR,
    MALFORMED_RESPONSE,
    TIMEOUT,
    ProviderError,
    classify_status,
    redact,
)
from .usage import Usage, parse_usage


@dataclass(slots=True)
class ChatResponse:
    content: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    headers: dict[str, str]
    refusal: str | None = None  # message.refusal: the model declined (content is then null)
    tool_calls: list[Any] | None = None  # message.tool_calls (or a legacy function_call)
    empty_choices: bool = False  # HTTP 200 with `choices: []`: billable, but no answer
    model: str | None = None  # the model that answered, as the provider names it
    cached_tokens: int | None = None  # prompt tokens served from the provider's cache
    usage: Usage | None = None  # None: the provider sent no readable usage block
    service_tier: str | None = None  # the tier that served it (flex, default), when named


class ChatTransport(Protocol):
    async def chat(self, body: dict[str, Any], timeout: float) -> ChatResponse: ...

    async def embed(self, body: dict[str, Any], timeout: float) -> tuple[Any, dict[str, str]]:
        """POST /embeddings: (the answer's JSON, its headers), or ProviderError."""
        ...

    async def aclose(self) -> None: ...


def parse_retry_after(headers: dict[str, str]) -> float | None:
    """Server hint in seconds: retry-after-ms, then retry-after (seconds or an HTTP date)."""
    value = headers.get("retry-after-ms")
    if value:
        try:
            return float(value) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value:
        try:
            return float(value)
        except ValueError:
            parsed = email.utils.parsedate_to_datetime(value) if value else None
            if parsed is not None:
                return max(0.0, parsed.timestamp() - time.time())
    return None


def retry_hint_is_exact(headers: dict[str, str]) -> bool:
    """retry-after-ms, or a fractional retry-after, is the wait; a whole-second retry-after is
    the wait rounded up (OpenAI sends `1` for 13 ms), so only an upper bound."""
    if headers.get("retry-after-ms"):
        return True
    value = headers.get("retry-after") or ""
    try:
        return float(value) != int(float(value))
    except ValueError:
        return False


def parse_completion(payload: Any, headers: dict[str, str]) -> ChatResponse:
    """The fields the engine needs from a chat.completion body; anything else is malformed."""
    try:
        choices = payload["choices"]
        usage = parse_usage(payload.get("usage"))
        if isinstance(choices, list) and not choices:
            return ChatResponse(
                content=None,
                finish_reason=None,
                prompt_tokens=usage.prompt_tokens if usage else None,
                completion_tokens=usage.completion_tokens if usage else None,
                headers=headers,
                empty_choices=True,
                usage=usage,
                model=payload.get("model") if isinstance(payload.get("model"), str) else None,
            )
        choice = choices[0]
        message = choice.get("message") or {}
        calls = message.get("tool_calls") or (
            [message["function_call"]] if message.get("function_call") else None
        )
        return ChatResponse(
            content=message.get("content"),
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            headers=headers,
            refusal=message.get("refusal") or None,
            tool_calls=list(calls) if calls else None,
            model=payload.get("model") if isinstance(payload.get("model"), str) else None,
            cached_tokens=usage.cached_tokens if usage else None,
            usage=usage,
            service_tier=_tier(payload.get("service_tier")),
        )
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ProviderError(
            MALFORMED_RESPONSE, f"unexpected response body: {exc!r}", status=200, retryable=True
        ) from exc


def _tier(value: Any) -> str | None:
    """The answer's `service_tier`: a short ASCII name (a row column, and what prices it)."""
    ok = isinstance(value, str) and value.isascii() and 0 < len(value) <= 32
    return value if ok else None


def error_from_body(status: int, text: str, headers: dict[str, str], secret: str) -> ProviderError:
    """OpenAI's error JSON ({"error": {"message", "type", "code"}}) or raw text, redacted."""
    code = param = None
    message = text[:500]
    try:
        err = json.loads(text).get("error") or {}
        if isinstance(err, dict):
            code = err.get("code") or err.get("type")
            code = code if isinstance(code, str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
            message = err.get("message") or message
        elif isinstance(err, str):
            message = err
    except (ValueError, AttributeError):
        pass
    if (
        code == "invalid_request_error"
        and "max_tokens" in str(message)
        and "not supported" in str(message)
    ):
        code = "unsupported_parameter"
    error_class, retryable = classify_status(status, code, headers, str(message))
    return ProviderError(
        error_class,
        redact(f"HTTP {status}: {message}", secret),
        status=status,
        retryable=retryable,
        retry_after_s=parse_retry_after(headers),
        headers=headers,
        code=code,
        param=param,
        hint_exact=retry_hint_is_exact(headers),
    )


class AiohttpTransport:
    """POST /chat/completions over one pooled aiohttp session (OpenAI or Azure URL forms)."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        api_version: str | None = None,
        model: str,
        max_connections: int = C.DEFAULT_MAX_CONCURRENCY,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        self._secret = api_key
        base = base_url.rstrip("/")
        if api_version:  # Azure OpenAI: the model names the deployment
            base = f"{base}/openai/deployments/{model}"
            self._params = {"api-version": api_version}
            auth = {"api-key": api_key}
        else:
            self._params = None
            auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._url, self._embed_url = f"{base}/chat/completions", f"{base}/embeddings"
        self._headers = {"Content-Type": "application/json", **auth, **(extra_headers or {})}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._timeout_obj: aiohttp.ClientTimeout | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, raise_for_status=False
            )
        return self._session

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        """One ClientTimeout per distinct value: without a deadline every request has the same."""
        if self._timeout_obj is None or self._timeout_obj.total != seconds:
            self._timeout_obj = aiohttp.ClientTimeout(total=seconds)
        return self._timeout_obj

    async def chat(self, body: dict[str, Any], timeout: float) -> ChatResponse:
        return parse_completion(*await self._post(self._url, body, timeout))

    async def embed(self, body: dict[str, Any], timeout: float) -> tuple[Any, dict[str, str]]:
        return await self._post(self._embed_url, body, timeout)

    async def _post(
        self, url: str, body: dict[str, Any], timeout: float
    ) -> tuple[Any, dict[str, str]]:
        session = self._session or self._get_session()
        try:
            async with session.post(
                url,
                data=_dumps(body),
                params=self._params,
                timeout=self._timeout(timeout),
            ) as resp:
                raw = await resp.read()  # bytes: orjson reads them without a str copy
                headers = {k.lower(): v for k, v in resp.headers.items()}
                status = resp.status
        except TimeoutError as exc:
            raise ProviderError(
                TIMEOUT, f"no answer within {timeout:.1f} s", retryable=True
            ) from exc
        except aiohttp.ClientError as exc:
            message = redact(f"{type(exc).__name__}: {exc}", self._secret)
            raise ProviderError(CONNECTION_ERROR, message, retryable=True) from exc
        if status >= 400:
            raise error_from_body(status, raw.decode(errors="replace"), headers, self._secret)
        try:
            payload = _loads(raw)
        except ValueError as exc:
            raise ProviderError(
                MALFORMED_RESPONSE,
                f"response is not JSON ({len(raw)} bytes)",
                status=status,
                retryable=True,
            ) from exc
        return payload, headers

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _dumps(body: dict[str, Any]) -> bytes | str:
    """The request's JSON. orjson takes a twentieth of json's time (4 us of a request's 170 in
    benchmarks/overhead.py); what it refuses (a lone surrogate in a row's text, an int over 64
    bits) goes through json, as before. Non-finite numbers, which orjson writes as null, never
    get here: the engine fails such a request (`Engine._prepare`)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body)


def _loads(body: bytes) -> Any:
    """An answer's JSON: orjson, and json for what orjson refuses (a lone surrogate escape,
    which json reads and the answer's checks then handle; bytes that are not UTF-8, read with
    replacement characters)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body.decode(errors="replace"))


_EXTRA_BODY_FIELDS = ("structured_outputs", "guided_json")


class OpenAISDKTransport:
    """The openai SDK (AsyncOpenAI / AsyncAzureOpenAI) with its own retries off."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        api_version: str | None = None,
        model: str,
        max_connections: int = C.DEFAULT_MAX_CONCURRENCY,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        import openai

        self._openai = openai
        self._secret = api_key
        common = {
            "api_key": api_key or "none",
            "max_retries": 0,  # the engine owns retries
            "default_headers": extra_headers,
        }
        if api_version:
            self._client = openai.AsyncAzureOpenAI(
                azure_endpoint=base_url, api_version=api_version, **common
            )
        else:
            self._client = openai.AsyncOpenAI(base_url=base_url, **common)

    async def chat(self, body: dict[str, Any], timeout: float) -> ChatResponse:
        # Typed outputs: fields the SDK does not name (vLLM's structured_outputs) go in the
        # body as they are, through extra_body.
        extra = {k: body[k] for k in _EXTRA_BODY_FIELDS if k in body}
        known = {k: v for k, v in body.items() if k not in extra}
        create = self._client.chat.completions.with_raw_response.create
        kw = {"extra_body": extra} if extra else {}
        return parse_completion(*await self._call(create, timeout, **known, **kw))

    async def embed(self, body: dict[str, Any], timeout: float) -> tuple[Any, dict[str, str]]:
        # encoding_format is always in the body: the SDK then returns the answer as sent.
        return await self._call(self._client.embeddings.with_raw_response.create, timeout, **body)

    async def _call(self, create: Any, timeout: float, **kw: Any) -> tuple[Any, dict[str, str]]:
        openai = self._openai
        try:
            raw = await create(**kw, timeout=timeout)
            headers = {k.lower(): v for k, v in raw.headers.items()}
            payload = json.loads(raw.text)
        except openai.APITimeoutError as exc:
            raise ProviderError(
                TIMEOUT, f"no answer within {timeout:.1f} s", retryable=True
            ) from exc
        except openai.APIConnectionError as exc:
            message = redact(f"{type(exc).__name__}: {exc}", self._secret)
            raise ProviderError(CONNECTION_ERROR, message, retryable=True) from exc
        except openai.APIStatusError as exc:
            headers = {k.lower(): v for k, v in exc.response.headers.items()}
            raise error_from_body(
                exc.status_code, exc.response.text, headers, self._secret
            ) from None
        except ValueError as exc:
            raise ProviderError(
                MALFORMED_RESPONSE, "response is not JSON", status=200, retryable=True
            ) from exc
        return payload, headers

    async def aclose(self) -> None:
        await self._client.close()


TRANSPORTS = {"aiohttp": AiohttpTransport, "openai": OpenAISDKTransport}
