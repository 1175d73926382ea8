"""The partition lease on a real redis-server: restarted empty or failed over mid-run, a run
that starts on a replica, Redis errors told apart by class, a password in the Redis URL.
(The lease on other processes and warehouses: test_lease.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
import redis
from redis import exceptions as rx

from batch_llm_assets.demo_data import create_demo_table

from .conftest import duckdb_query as query
from .test_lease import KEY_PREFIX, InThread, sent, succeeded, wait_for

REDIS_SERVER = "/usr/bin/redis-server"


# -- Redis restarted or failed over mid-run ---------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server this test starts, stops and restarts on one port."""

    def __init__(self, tmp_path, *args: str, password: str | None = None) -> None:
        if not os.path.exists(REDIS_SERVER):
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.port, self.dir, self.password = _free_port(), tmp_path, password
        self.args = [*args, *(("--requirepass", password) if password else ())]
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def start(self) -> RedisServer:
        argv = [REDIS_SERVER, "--port", str(self.port), "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.dir), *self.args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        wait_for("redis-server to answer", self._answers, self.proc, timeout_s=30)
        return self

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def lease_holders(self) -> list[bytes]:
        c = self.client()
        return [c.get(k) or b"" for k in c.scan_iter(KEY_PREFIX + "*")]

    def readonly_refusals(self) -> int:
        stats = self.client().info("errorstats")
        return int(stats.get("errorstat_READONLY", {}).get("count", 0))


@pytest.fixture
def servers(tmp_path):
    started: list[RedisServer] = []

    def make(*args: str, password: str | None = None) -> RedisServer:
        path = tmp_path / f"redis{len(started)}"
        path.mkdir()
        started.append(RedisServer(path, *args, password=password))
        return started[-1]

    yield make
    for server in started:
        server.stop()


def test_a_redis_restart_mid_run_retakes_the_lease_and_the_run_goes_on(
    fresh_sim, tmp_path, servers
):
    """A 2 s restart of an empty Redis: the next renewal claims the lease again (nobody else
    holds it) and the run ends green (before: red, blaming a 'stalled process')."""
    db = str(tmp_path / "restart.duckdb")
    create_demo_table(db, days=1, per_day=20)
    server = servers().start()
    with InThread(fresh_sim, db, server.url) as run:
        wait_for("the run's first request", lambda: sent(fresh_sim) >= 1)
        assert len(server.lease_holders()) == 1
        server.stop()
        time.sleep(2.0)  # the outage itself
        server.start()  # empty: no lease, no scripts
        wait_for("the lease to be claimed again", server.lease_holders, timeout_s=15)
        assert succeeded(run.finish())
    assert query(db, "SELECT count(*), min(status) FROM news_sentiment") == [(20, "ok")]


def test_a_failover_mid_run_is_an_outage_and_the_lease_is_claimed_again(
    fresh_sim, tmp_path, servers
):
    """The run's Redis becomes a replica (REPLICAOF: READONLY to every write, its data replaced
    by the new primary's), then is promoted again: the renewals refused READONLY wait, the
    lease is claimed again, the run ends green (before: red once the key was gone)."""
    db = str(tmp_path / "failover.duckdb")
    create_demo_table(db, days=1, per_day=20)
    primary, other = servers().start(), servers().start()
    with InThread(fresh_sim, db, primary.url) as run:
        wait_for("the run's first request", lambda: sent(fresh_sim) >= 1)
        primary.client().replicaof("127.0.0.1", other.port)
        wait_for("a renewal refused READONLY", lambda: primary.readonly_refusals() >= 1)
        wait_for("the replica to drop its data", lambda: not primary.lease_holders())
        primary.client().replicaof("NO", "ONE")
        wait_for("the lease to be claimed again", primary.lease_holders, timeout_s=15)
        assert succeeded(run.finish())


def test_a_run_that_starts_on_a_replica_waits_for_the_failover_to_end(fresh_sim, tmp_path, servers):
    """Taking the lease on a server that answers READONLY (a failover in progress) is waited
    out, not a failure (before: failed at once, the error read by its text)."""
    db = str(tmp_path / "replica.duckdb")
    create_demo_table(db, days=1, per_day=20)
    primary, other = servers().start(), servers().start()
    primary.client().replicaof("127.0.0.1", other.port)
    with InThread(fresh_sim, db, primary.url, latency_ms=5.0) as run:
        wait_for("the lease's claim refused READONLY", lambda: primary.readonly_refusals() >= 1)
        assert sent(fresh_sim) == 0
        primary.client().replicaof("NO", "ONE")
        assert succeeded(run.finish())
    assert query(db, "SELECT count(*), min(status) FROM news_sentiment") == [(20, "ok")]


@pytest.mark.parametrize(
    "error, outage",
    [
        (rx.ReadOnlyError("You can't write against a read only replica."), True),
        (rx.MovedError("3999 127.0.0.1:6381"), True),
        (rx.AskError("3999 127.0.0.1:6381"), True),
        (rx.TryAgainError("Multiple keys request during rehashing of slot"), True),
        (rx.ClusterDownError("The cluster is down"), True),
        (rx.MasterDownError("Link with MASTER is down and replica-serve-stale-data is no"), True),
        (rx.BusyLoadingError("Redis is loading the dataset in memory"), True),
        (rx.ConnectionError("Error 111 connecting"), True),
        (rx.TimeoutError("Timeout reading from socket"), True),
        (rx.AuthenticationError("invalid username-password pair"), False),
        (rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), False),
        (ValueError("Port could not be cast to integer value"), False),
    ],
)
def test_lease_store_errors_are_told_apart_by_class(error, outage):
    """redis-py strips the reply's code from the message: the class says what it was."""
    from batch_llm_assets.assets.lease_redis import RedisLeaseStore

    assert RedisLeaseStore("redis://127.0.0.1:1/0").transient(error) is outage


# -- secrets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_a_password_in_the_redis_url_appears_in_no_message_or_log(
    fresh_sim, tmp_path, servers, caplog, form
):
    secret = "planted-redis-pw-7f3a9c"
    server = servers(password="the-right-one").start()
    url = (
        f"redis://:{secret}@127.0.0.1:{server.port}/0"
        if form == "userinfo"
        else f"redis://127.0.0.1:{server.port}/0?password={secret}"
    )
    db = str(tmp_path / "pw.duckdb")
    create_demo_table(db, days=1, per_day=5)
    with caplog.at_level("DEBUG"), InThread(fresh_sim, db, url, latency_ms=5.0) as run:
        result = run.finish()
    assert not result.success
    error = result.get_step_failure_events()[0].step_failure_data.error
    events = [str(e) for e in result.all_events]
    haystack = "\n".join([caplog.text, str(error), *events])
    assert f"127.0.0.1:{server.port}" in error.message  # the server is named...
    assert secret not in haystack  # ...without its password
    assert sent(fresh_sim) == 0
