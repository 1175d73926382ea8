"""The simulator in its own process, as tests, benchmarks and the demo run it."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any


class SimulatorProcess:
    """`batch-llm-assets sim` on a free port; `stats()`, `configure()` and `reset()` over HTTP."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> SimulatorProcess:
        args = [sys.executable, "-m", "batch_llm_assets.cli", "sim", "--port", "0"]
        for key, value in self.settings.items():
            if value is not None:
                value = json.dumps(value) if isinstance(value, dict) else str(value)
                args += [f"--{key.replace('_', '-')}", value]
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if "listening on " not in line:
            self.stop()
            raise RuntimeError(f"simulator did not start: {line!r}")
        self.url = line.split("listening on ", 1)[1].strip()
        return self

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.root + path, data=data, method="POST" if data else "GET")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stats(self, *, log: bool = False, messages: bool = False) -> dict[str, Any]:
        """GET /stats; with `log`, each admission's time and tokens too; with `messages`, the
        latest chat requests' messages (stats.py)."""
        query = "&".join(q for q, on in (("log=1", log), ("messages=1", messages)) if on)
        return self._request(f"/stats?{query}" if query else "/stats")

    def configure(self, **settings: Any) -> None:
        self._request("/admin/config", settings)

    def reset(self) -> None:
        self._request("/admin/reset", {})

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            if self._proc.stdout:
                self._proc.stdout.close()
            self._proc = None

    def __enter__(self) -> SimulatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
