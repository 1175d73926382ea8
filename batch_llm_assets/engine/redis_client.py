"""The limiter's Redis: connect, check, and what a Redis error means.

redis-py turns a reply's error code into an exception class (`ReadOnlyError`, `MovedError`,
...) and strips the code from the message, so errors are told apart by class, never by message
text. A code redis-py has no class for (`BUSY`: a script running too long, `WRONGTYPE`) stays a
plain `ResponseError` whose message starts with it; `ERR` it strips. An error raised while our
script runs carries "script: <sha>" whatever its cause: a code or a class (`OutOfMemoryError`)
says the server refused a command, and only an error without either is the script's own (Lua
failing, or a command we built wrong).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Literal

import redis.asyncio as aioredis
from redis import exceptions as rx

from . import _constants as C
from .errors import (
    LimiterAuthError,
    LimiterError,
    LimiterRefusedError,
    LimiterScriptError,
    LimiterUnavailableError,
)

log = logging.getLogger(__name__)

ErrorKind = Literal["outage", "auth", "script", "refused"]

# A failover or a resharding in progress, or a server still loading its data: what an outage
# looks like from a client; retried until the outage budget runs out.
_OUTAGE_CLASSES = (
    rx.ConnectionError,  # includes BusyLoadingError (LOADING) and MaxConnectionsError
    rx.TimeoutError,
    rx.ReadOnlyError,  # READONLY: the node became a replica
    rx.AskError,  # ASK, and MOVED (a subclass): slots moving
    rx.TryAgainError,  # TRYAGAIN
    rx.ClusterDownError,  # CLUSTERDOWN, and MASTERDOWN (a subclass)
    rx.SlotNotCoveredError,
    OSError,
)
_AUTH_CLASSES = (rx.AuthenticationError, rx.AuthorizationError, rx.NoPermissionError)


def _reply_code(exc: BaseException) -> str:
    """The reply's error code left in a plain ResponseError's message ('' if none)."""
    first = str(exc).split(" ", 1)[0]
    return first if type(exc) is rx.ResponseError and first.isalpha() and first.isupper() else ""


def error_kind(exc: BaseException) -> ErrorKind:
    """What a Redis error means for a caller: an outage to wait out, refused credentials or
    permissions, a bug in our script, or a refusal no retry fixes (OOM, a wrong type)."""
    if isinstance(exc, _AUTH_CLASSES):
        return "auth"
    if isinstance(exc, _OUTAGE_CLASSES) or _reply_code(exc) == "BUSY":
        return "outage"
    if isinstance(exc, rx.NoScriptError):
        return "script"
    if type(exc) is rx.ResponseError and not _reply_code(exc) and "script" in str(exc).lower():
        return "script"
    return "refused"


_KINDS: dict[str, type[LimiterError]] = {
    "outage": LimiterUnavailableError,
    "auth": LimiterAuthError,
    "script": LimiterScriptError,
    "refused": LimiterRefusedError,
}


def limiter_error(exc: BaseException, where: str, doing: str) -> LimiterError:
    """The library's error for a Redis error, naming the server (without its password)."""
    kind = error_kind(exc)
    what = {
        "outage": "is unavailable",
        "auth": "refused the credentials or permissions",
        "script": "failed running the limiter's script",
        "refused": "refused the command",
    }[kind]
    return _KINDS[kind](
        f"Limiter Redis at {where} {what} while {doing} ({type(exc).__name__}: {exc})"
    )


def safe_url(url: str) -> str:
    """The URL for messages: no password in the user part or in the query string."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    if parts.username:
        host = f"{parts.username}:***@{host}" if parts.password else f"{parts.username}@{host}"
    elif parts.password:
        host = f":***@{host}"
    query = urllib.parse.urlencode(
        [
            (k, "***" if k.lower() in ("password", "pass", "pwd", "token") else v)
            for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        ]
    )
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, query, ""))


def connect_redis(url: str, *, timeout_s: float = C.REDIS_CONNECT_TIMEOUT_S):
    """A client for a redis://, rediss://, unix:// URL, or a Redis Cluster for
    redis+cluster:// / rediss+cluster:// (every key of one limiter shares one hash slot)."""
    opts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    for prefix in ("redis+cluster://", "rediss+cluster://"):
        if url.startswith(prefix):
            plain = url.replace("+cluster", "", 1)
            return aioredis.RedisCluster.from_url(plain, **opts)
    # Blocking: a command waits for a free connection instead of opening one more.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=C.REDIS_MAX_CONNECTIONS, timeout=None, **opts
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes both


async def check_redis(client, url: str, *, timeout_s: float = C.REDIS_CONNECT_TIMEOUT_S) -> None:
    """Connect and authenticate now, so a wrong password, port or TLS setting fails the run in
    seconds with a clear message instead of every row waiting out an 'outage'."""
    where = safe_url(url)
    try:
        async with asyncio.timeout(timeout_s):
            await client.ping()
    except TimeoutError as exc:
        raise LimiterUnavailableError(
            f"Limiter Redis at {where} could not be reached within {timeout_s:.0f} s. Check "
            "the host, the port and rediss:// (TLS) in redis_url."
        ) from exc
    except (rx.RedisError, OSError) as exc:
        err = limiter_error(exc, where, "connecting")
        if isinstance(err, LimiterUnavailableError):
            err = LimiterUnavailableError(
                f"Limiter Redis at {where} could not be reached ({type(exc).__name__}: {exc}). "
                "Check the host, the port and rediss:// (TLS) in redis_url."
            )
        elif isinstance(err, LimiterAuthError):
            err = LimiterAuthError(f"{err.description}. Check the user and password in redis_url.")
        raise err from exc


class Warnings:
    """One log line per kind per `every_s` seconds, with how many were held back."""

    def __init__(self, every_s: float = C.WARN_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        log.warning(msg + (f" ({held} more like it not shown)" if held else ""), *args)


def _warn_outage(kind: str, msg: str, *args: object) -> None:
    log.warning(msg, *args)


async def call_script(
    script: Any,
    *,
    keys: list[str],
    args: list[Any],
    where: str,
    doing: str,
    outage_s: float,
    wait: bool = True,
    warn: Callable[..., None] = _warn_outage,
) -> Any:
    """A registered script's reply; an outage is retried with backoff for up to `outage_s`
    (unless not `wait`), any other Redis error raised at once as the library's error."""
    give_up = time.monotonic() + outage_s
    delay = C.LIMITER_RETRY_DELAY_S
    while True:
        try:
            return await script(keys=keys, args=args)
        except (rx.RedisError, OSError) as exc:
            if error_kind(exc) != "outage" or not wait or time.monotonic() + delay > give_up:
                err = limiter_error(exc, where, doing)
                if error_kind(exc) == "outage" and wait:
                    err = LimiterUnavailableError(
                        f"{err.description}; gave up after {outage_s:.0f} s"
                    )
                raise err from exc
            warn(type(exc).__name__, "Limiter Redis unavailable (%s); retrying.", exc)
            delay = await backoff(delay)


async def backoff(delay: float) -> float:
    """Sleep a jittered `delay` (half to all of it); the next one, doubled up to the maximum."""
    await asyncio.sleep(delay * (0.5 + random.random() / 2))
    return min(delay * 2, C.LIMITER_MAX_RETRY_DELAY_S)
