"""A real MLflow tracking server on loopback for the tests (`mlflow server`,
from requirements-trackers.txt), in a process group of its own: a SQLite
store and proxied artifacts in a temporary folder, a port from
common.ports.free_port, waited for with a bounded deadline, killed after."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.ports import free_port

# uvicorn and MLflow's app load in 3 s on an idle machine, 26 s on a loaded 2-core one: a generous bound.
START_DEADLINE_S = 180.0


class MlflowServer:
    """`mlflow server` on 127.0.0.1 at a free port, storing under `folder`, until stop()."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "server.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                 "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_DEADLINE_S
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not answer on port {self.port} within {START_DEADLINE_S} s: "
                                   f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                return answer.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the server and its uvicorn workers
        self.process.wait()
