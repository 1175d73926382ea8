"""The queue worker as a process (`batch-llm-assets worker`) on real Valkey and the simulator:
kill -9 mid-request, SIGTERM's drain, its flags and env vars, and what it may import."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import redis.asyncio as aioredis

from batch_llm_assets.worker import QueueNames, submit
from batch_llm_assets.worker.cli import add_arguments, duration, settings_from_args

from .conftest import SIM_KEY
from .test_worker import MODEL, message, names, running, sample, settings, wait_results


@pytest.fixture
def prefix():
    return f"wp{uuid.uuid4().hex[:10]}"


async def bounded(coro, timeout_s: float):
    """Await `coro`; if it hangs, fail with every task's stack (this test hung in 2 of 18 runs
    of this file: the backlog poller lost its cancel in a redis-py call, test_cancel.py)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        stacks = io.StringIO()
        for t in asyncio.all_tasks():
            if t is not asyncio.current_task():
                t.print_stack(file=stacks)
        task.cancel()
        raise AssertionError(f"hung for {timeout_s} s; the tasks:\n{stacks.getvalue()}")
    return task.result()


def worker_command(sim, url: str, queues: QueueNames, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "batch_llm_assets.cli",
        "worker",
        "--redis.url",
        url,
        "--redis.ss.igw-base-url",
        sim.url,
        "--model",
        MODEL,
        "--redis.ss.request-queue-name",
        queues.request_sortedset,
        "--redis.retry-queue-name",
        queues.retry_sortedset,
        "--redis.ss.result-queue-name",
        queues.result_list,
        "--redis.ss.poll-interval-ms",
        "50",
        "--visibility-timeout",
        "2s",
        "--metrics-port",
        "0",
        *extra,
    ]


def start_worker(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OPENAI_API_KEY": SIM_KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    for _ in range(2):
        line = proc.stdout.readline() if proc.stdout else ""
        if "worker serving" in line:
            return proc
    proc.kill()
    raise RuntimeError(f"worker did not start: {line!r}")


def wait_received(sim, n: int, timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while sim.stats().get("received", 0) < n:
        assert time.monotonic() < give_up, f"the simulator did not receive {n} requests"
        time.sleep(0.05)


async def enqueue(url: str, queues: QueueNames, ids: list[str]) -> None:
    client = aioredis.Redis.from_url(url)
    for i in ids:
        await submit(client, message(i), sortedset=queues.request_sortedset)
    await client.aclose()


def test_kill_9_mid_request_another_worker_finishes_its_messages(fresh_sim, valkey_url, prefix):
    queues = names(prefix)
    fresh_sim.configure(latency_ms=30_000)  # requests hang until the worker is killed
    ids = [f"k{i}" for i in range(4)]
    asyncio.run(enqueue(valkey_url, queues, ids))
    victim = start_worker(worker_command(fresh_sim, valkey_url, queues))
    try:
        wait_received(fresh_sim, len(ids))
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        victim.kill()
        if victim.stdout:
            victim.stdout.close()
    fresh_sim.configure(latency_ms=5.0)

    async def rescue():
        client = aioredis.Redis.from_url(valkey_url)
        assert await client.zcard(queues.processing_set) == len(ids)  # held by the dead worker
        async with running(settings(fresh_sim, valkey_url, queues)) as parts:
            results = await wait_results(client, queues.result_list, len(ids))
            reclaimed = sample(parts, "batch_llm_worker_reclaimed_messages_total", queues)
        await client.aclose()
        return results, reclaimed

    results, reclaimed = asyncio.run(bounded(rescue(), 90.0))
    assert sorted(r["id"] for r in results) == ids
    assert all(r["status_code"] == 200 for r in results)
    assert reclaimed == len(ids)
    assert fresh_sim.stats()["answered"] == len(ids)


@pytest.mark.parametrize("drain", ["10s", "100ms"])
def test_sigterm_finishes_or_hands_back_in_flight_messages(fresh_sim, valkey_url, prefix, drain):
    queues = names(prefix)
    fresh_sim.configure(latency_ms=1500)
    ids = [f"t{i}" for i in range(3)]
    asyncio.run(enqueue(valkey_url, queues, ids))
    proc = start_worker(worker_command(fresh_sim, valkey_url, queues, "--drain-timeout", drain))
    try:
        wait_received(fresh_sim, len(ids))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        if proc.stdout:
            proc.stdout.close()

    async def inspect():
        client = aioredis.Redis.from_url(valkey_url)
        out = (
            await client.llen(queues.result_list),
            await client.zcard(queues.request_sortedset),
            await client.zcard(queues.processing_set),
        )
        await client.aclose()
        return out

    results, queued, processing = asyncio.run(inspect())
    assert processing == 0
    if drain == "10s":
        assert (results, queued) == (3, 0)  # in-flight requests finished
    else:
        assert (results, queued) == (0, 3)  # handed back at once, for another worker


def test_flags_and_env_vars_build_settings(monkeypatch):
    import argparse

    monkeypatch.setenv("REDIS_URL", "redis://queue:6379/0")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://gateway/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-0123456789")
    monkeypatch.setenv("BATCH_LLM_WORKER_JOB_WEIGHT", "3")
    p = argparse.ArgumentParser()
    add_arguments(p)
    s = settings_from_args(
        p.parse_args(["--model", MODEL, "--drain-timeout", "1m30s", "--rpm", "500"])
    )
    s.validate()
    assert (s.redis_url, s.base_url, s.job_weight, s.drain_timeout_s) == (
        "redis://queue:6379/0",
        "http://gateway/v1",
        3.0,
        90.0,
    )
    assert s.queues.request_sortedset == "request-sortedset"  # llm-d's defaults
    assert s.queues.result_list == "result-list"
    assert s.rpm == 500 and "sk-secret" not in repr(s)
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        duration("5 minutes")
    monkeypatch.delenv("OPENAI_BASE_URL")
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="igw-base-url"):
        settings_from_args(p.parse_args(["--model", MODEL]))


def test_the_worker_imports_the_engine_only():
    """ARCHITECTURE.md: worker/ may import the engine, never Dagster, resources or assets."""
    import ast
    from pathlib import Path

    import batch_llm_assets.worker as pkg

    allowed_ours = {
        "engine",
        "engine.transport",
        "engine._constants",
        "engine.errors",
        "engine.outcome",
    }
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                assert node.module in allowed_ours, f"{path.name} imports ..{node.module}"
            names = [a.name for a in getattr(node, "names", [])]
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                mod = getattr(node, "module", None) or ""
                assert not any(n.startswith("dagster") for n in [mod, *names]), path.name
