"""One run per asset partition at a time: a lease taken before anything is read or sent.

Where the lease lives decides who sees it:
- a shared Redis (`redis_url`): a key every host sees, with a short TTL (5 s) a background
  thread renews every second;
- without one, the warehouse's own store when it is shared between hosts (BigQuery: a row of a
  lease table, claimed by a conditional MERGE, 60 s TTL);
- else (DuckDB, one host by nature) an `flock` on a file next to the journal, which the OS
  releases when its holder dies.
A second run fails at once, naming the run that holds the partition, and never touches that
run's journal. A holder that died on this machine (its pid gone, or another process now) is
taken over at once; on another host, a TTL after its last renewal. A lease that vanished (an
empty Redis after a restart, a failover) is claimed again by the next renewal if nobody else
took it; an outage in between only delays the renewal. The run stops only when another run
holds its partition.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..engine import _constants as C
from ..engine.errors import BatchLLMError
from ..warehouses.base import LeaseStore
from .lease_redis import RedisLeaseStore

DEFAULT_LEASE_TTL_S = C.LEASE_TTL_S

log = logging.getLogger(__name__)


class PartitionBusyError(BatchLLMError):
    """Another run holds this asset partition."""


class LeaseLostError(BatchLLMError):
    """Another run took the partition's lease while this run held it."""


# -- who holds a lease, and whether it is still alive ----------------------------------------------
def _machine() -> str | None:
    """This machine and pid namespace (pids mean something only within one), or None where
    /proc cannot say (then a dead holder is known only by its lease lapsing)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{socket.gethostname()}|{boot}|{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _process_start(pid: Any) -> str | None:
    """When process `pid` started (clock ticks after boot), None if there is no such live
    process (a zombie is dead): with the pid, it tells a process from a later one that reused
    its pid."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def holder_info(run_id: str | None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": _machine(),
        "start": _process_start(os.getpid()),
        "lease": uuid.uuid4().hex[:12],  # two runs without a Dagster run id still differ
    }


def holder_is_dead(holder: dict[str, Any] | None) -> bool:
    """True only when the holder is known to be gone: it ran on this machine and its process
    has ended (its pid is free, a zombie, or another process's now)."""
    if not holder or not holder.get("machine") or holder.get("machine") != _machine():
        return False
    pid, start = holder.get("pid"), holder.get("start")
    if not isinstance(start, str) or type(pid) is not int:  # nothing to compare: it may live
        return False
    return _process_start(pid) != start


def _parse(raw: str | None) -> dict[str, Any] | None:
    try:
        holder = json.loads(raw) if raw else None
    except (ValueError, TypeError):
        return None
    return holder if isinstance(holder, dict) else None


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


# -- the lease a run holds -------------------------------------------------------------------------
class PartitionLease:
    """Held for one run; `check()` raises once another run took the partition."""

    def __init__(self) -> None:
        self.lost = False
        self.taken_by: dict[str, Any] | None = None

    def check(self) -> None:
        if self.lost:
            raise LeaseLostError(
                description=f"The partition's lease was taken by {_describe(self.taken_by)} "
                "while this run held it (this process could not renew it within its TTL: it "
                "stalled, or its lease store was cut off), so this run stopped: one run sends."
            )


class _Renewed(PartitionLease):
    """A lease in a shared store, claimed again by a thread every TTL / renewals."""

    def __init__(self, store: LeaseStore, name: str, token: str) -> None:
        super().__init__()
        self.store, self.name, self.token = store, name, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"lease-{name[:12]}", daemon=True)

    def _keep(self) -> None:
        every = self.store.ttl_s / C.LEASE_RENEWALS_PER_TTL
        while not self._stop.wait(every):
            try:
                holder = self.store.claim(self.name, self.token)
            except Exception as exc:  # an outage: nobody can take it meanwhile; try again
                log.debug("lease renewal failed (%s); retrying", type(exc).__name__)
                continue
            if holder is not None:  # renewed, or claimed again after it vanished: None
                self.taken_by, self.lost = _parse(holder), True
                return

    def __enter__(self) -> _Renewed:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self.store.release(self.name, self.token)


def _take(store: LeaseStore, name: str, label: str, token: str) -> None:
    """Claim the lease, taking it over from a holder known to be dead; waits out an outage of
    the store for up to LEASE_TAKE_OUTAGE_S."""
    give_up = time.monotonic() + C.LEASE_TAKE_OUTAGE_S
    delay = 0.1
    while True:
        try:
            raw = store.claim(name, token)
            if raw is None:
                return
            holder = _parse(raw)
            if holder_is_dead(holder):
                log.warning(
                    "Partition %s: taking over the lease of %s, whose process has ended.",
                    label,
                    _describe(holder),
                )
                raw = store.claim(name, token, replacing=raw)
                if raw is None:
                    return
                holder = _parse(raw)
            raise _busy(label, holder)
        except PartitionBusyError:
            raise
        except Exception as exc:
            if not store.transient(exc) or time.monotonic() + delay > give_up:
                first = (str(exc).splitlines() or [""])[0][:300]
                raise BatchLLMError(
                    description=f"Could not take the lease of partition {label} in "
                    f"{store.where} ({type(exc).__name__}: {first}); nothing was read or sent."
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


@contextlib.contextmanager
def shared_lease(
    store: LeaseStore, name: str, label: str, run_id: str | None
) -> Iterator[PartitionLease]:
    """The lease `name` in a store other hosts see, renewed until the block ends."""
    token = json.dumps(holder_info(run_id))
    try:
        _take(store, name, label, token)
        with _Renewed(store, name, token) as lease:
            yield lease
    finally:
        store.close()


def redis_lease(
    url: str, name: str, label: str, run_id: str | None, *, ttl_s: float = DEFAULT_LEASE_TTL_S
) -> contextlib.AbstractContextManager[PartitionLease]:
    """A key in the shared Redis: claimed if free, renewed every TTL / renewals."""
    return shared_lease(RedisLeaseStore(url, ttl_s=ttl_s), name, label, run_id)


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
        return _parse(path.read_text())
    except OSError:
        return None


def partition_lease(
    *,
    name: str,
    label: str,
    run_id: str | None,
    lock_dir: Path,
    redis_url: str | None,
    store: LeaseStore | None = None,
    ttl_s: float = DEFAULT_LEASE_TTL_S,
) -> contextlib.AbstractContextManager[PartitionLease]:
    """The Redis lease when a shared Redis is configured, else the warehouse's shared `store`
    (BigQuery), else a local file lock. `ttl_s` is the Redis lease's."""
    if redis_url:
        if store is not None:
            store.close()
        return redis_lease(redis_url, name, label, run_id, ttl_s=ttl_s)
    if store is not None:
        return shared_lease(store, name, label, run_id)
    return file_lease(lock_dir / f"{name}.lock", label, run_id)
