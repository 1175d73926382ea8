"""A local BigQuery emulator (PyPI `bqemulator`) in a process of its own, for the tests and the
benchmarks: `BigQueryEmulatorProcess(workdir, project)` as a context manager gives its REST URL.

bqemulator has no flag, BQEMU_* variable or hook to skip loading DuckDB's spatial extension at
boot (DuckDBEngine.start always runs INSTALL/LOAD spatial, which downloads it and fails offline),
so the launcher replaces that one step with a no-op before the server is built: GEOGRAPHY is not
needed. The Avro extension download is switched off with its documented setting
(enable_format_extensions=False). The REST port, chosen free by the OS, is written to a file; the
emulator stops when its stdin closes (or on SIGTERM/SIGINT).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = r"""
import asyncio, os, signal, sys
from bqemulator.config import Settings
from bqemulator.server import EmulatorServer
from bqemulator.storage.engine import DuckDBEngine

DuckDBEngine._load_spatial = lambda self: None  # see batch_llm_assets/simulator/bqemulator.py

async def main(port_file):
    server = EmulatorServer(Settings(
        rest_host="127.0.0.1", rest_port=0, grpc_host="127.0.0.1", grpc_port=0,
        enable_format_extensions=False, default_project_id=sys.argv[2],
        log_level="warning", log_format="console", metrics_enabled=False,
    ))
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.run_in_executor(None, lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.rest_port))
    os.replace(port_file + ".tmp", port_file)
    try:
        await stop.wait()
    finally:
        await server.stop()

asyncio.run(main(sys.argv[1]))
os._exit(0)  # don't wait for the stdin reader thread
"""
START_TIMEOUT_S = 90.0  # the first start imports DuckDB and the emulator: slow on a busy host
STOP_TIMEOUT_S = 20.0


class BigQueryEmulatorProcess:
    """bqemulator for `project`, its files and log under `workdir`; `url` once started."""

    def __init__(self, workdir: str | Path, project: str) -> None:
        self.workdir = Path(workdir)
        self.project = project
        self.url = ""
        self.log_path = self.workdir / "emulator.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BigQueryEmulatorProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCHER, str(port_file), self.project],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,  # so no .bqemu.toml of the caller's is picked up
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"bqemulator did not start:\n{self.log_path.read_text()[-4000:]}"
                )
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()  # the launcher stops on EOF
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> BigQueryEmulatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
