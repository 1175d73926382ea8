"""One run per asset partition at a time: a lease taken before anything is read or sent.

With a shared Redis (`redis_url`) the lease is a key with a short TTL that a background thread
renews; it lapses a TTL after its holder dies. Without one, it is an `flock` on a file next to
the journal, which the OS releases when the holder dies. Either way a second run fails at once,
naming the run that holds the partition, and never touches that run's journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from ..engine.errors import BatchLLMError

DEFAULT_LEASE_TTL_S = 30.0
_KEY_PREFIX = "batch_llm:partition_lease:"

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class PartitionBusyError(BatchLLMError):
    """Another run holds this asset partition."""


class LeaseLostError(BatchLLMError):
    """The lease lapsed while the run held it (the process stalled past the TTL)."""


def holder_info(run_id: str | None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another run (unknown)"
    who = f"run {holder['run_id']}" if holder.get("run_id") else "a run without a Dagster run id"
    return f"{who} (pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')})"


def _busy(label: str, holder: dict[str, Any] | None) -> PartitionBusyError:
    return PartitionBusyError(
        description=f"Partition {label} is already being processed by {_describe(holder)}; "
        "nothing was read or sent. Wait for that run to finish (or terminate it) and rerun.",
        metadata={"holder_run_id": (holder or {}).get("run_id") or ""},
    )


class PartitionLease:
    """Held for one run; `lost` turns true if a Redis lease could not be kept."""

    def __init__(self) -> None:
        self.lost = False

    def check(self) -> None:
        if self.lost:
            raise LeaseLostError(
                description="The partition's lease lapsed during the run (the process stalled "
                "longer than its TTL), so another run may have started; this run stopped."
            )


@contextlib.contextmanager
def file_lease(lock_path: Path, label: str, run_id: str | None) -> Iterator[PartitionLease]:
    """An exclusive flock on `lock_path`; the holder's details are written into the file."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(label, _read_holder(lock_path)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_info(run_id)).encode(), 0)
        yield PartitionLease()
    finally:
        os.close(fd)  # releases the flock; the file stays (unlinking it would race a new holder)


def _read_holder(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def redis_lease(
    url: str, name: str, label: str, run_id: str | None, *, ttl_s: float = DEFAULT_LEASE_TTL_S
) -> Iterator[PartitionLease]:
    """A key in the shared Redis, SET NX with a TTL and renewed every third of it."""
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    key = _KEY_PREFIX + name
    token = json.dumps(holder_info(run_id))
    ttl_ms = max(1, int(ttl_s * 1000))
    try:
        if not client.set(key, token, nx=True, px=ttl_ms):
            raw = client.get(key)
            holder = None
            with contextlib.suppress(ValueError, TypeError):
                holder = json.loads(raw) if raw else None
            raise _busy(label, holder)
    except redis.RedisError as exc:
        client.close()
        raise BatchLLMError(
            description=f"Could not take the partition lease in Redis: {type(exc).__name__}; "
            "nothing was sent."
        ) from None
    lease = PartitionLease()
    stop = threading.Event()
    renew = client.register_script(_RENEW)

    def keep() -> None:
        last_ok = time.monotonic()
        while not stop.wait(ttl_s / 3):
            try:
                if renew(keys=[key], args=[token, ttl_ms]):
                    last_ok = time.monotonic()
                else:
                    lease.lost = True
                    return
            except redis.RedisError:
                if time.monotonic() - last_ok > ttl_s:
                    lease.lost = True
                    return

    thread = threading.Thread(target=keep, name=f"lease-{name[:12]}", daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            client.register_script(_RELEASE)(keys=[key], args=[token])
        client.close()


def partition_lease(
    *,
    name: str,
    label: str,
    run_id: str | None,
    lock_dir: Path,
    redis_url: str | None,
    ttl_s: float = DEFAULT_LEASE_TTL_S,
) -> contextlib.AbstractContextManager[PartitionLease]:
    """The Redis lease when a shared Redis is configured, else a local file lock."""
    if redis_url:
        return redis_lease(redis_url, name, label, run_id, ttl_s=ttl_s)
    return file_lease(lock_dir / f"{name}.lock", label, run_id)
