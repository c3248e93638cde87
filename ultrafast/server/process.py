"""An `ultrafast serve` in a child process on a loopback port: started, waited for until /health answers, stopped
(SIGTERM, then SIGKILL) or killed. What `ultrafast evals` and `ultrafast cluster` run their servers with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def sigterm_as_interrupt():
    """Inside: SIGTERM raises KeyboardInterrupt, so `kill` stops a command as Ctrl-C does (its results so far
    kept, the servers it started stopped). A shell starts a background job with SIGINT ignored, so `kill` is
    how such a job is stopped. The previous handler comes back after."""
    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> None:
    """Until GET url/health answers 200; RuntimeError (with the log's tail) if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"the server exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"no healthy server at {url} within {timeout:.0f} s")


class ServeProcess:
    """`ultrafast serve --port PORT ARGS...`, its output appended to `log`."""

    def __init__(self, args: list[str], log: Path, port: int | None = None, host: str = "127.0.0.1"):
        self.args, self.log, self.host = list(args), Path(log), host
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 900) -> "ServeProcess":
        cmd = [sys.executable, "-m", "ultrafast.cli", "serve", "--host", self.host, "--port", str(self.port),
               *self.args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(self.url, self.proc, timeout, self.log)
        except BaseException:
            self.kill()
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the process group: no chance to clean up (a crash)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (graceful: in-flight requests are cancelled and billed), SIGKILL if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode
