"""The server an eval talks to: the one at `--url`, or an `ultrafast serve` started for the run on a free
loopback port (and stopped after it), with enough slots for the run's candidates to decode together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"the server exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no healthy server at {url} within {timeout:.0f} s")


def _model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    return models[0]["id"]


@contextmanager
def served(args, slots: int):
    """(base URL of the OpenAI API, the model's name): `args.url`'s server, or one started for the run from
    `args.model` (`args.max_context`, `args.threads`)."""
    if args.url:
        url = args.url.rstrip("/")
        url = url[:-3] if url.endswith("/v1") else url
        _wait_healthy(url, None, 30, None)
        yield url + "/v1", _model(url, args.api_key)
        return
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="ultrafast-evals-"))
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "ultrafast.cli", "serve", "--model", args.model, "--port", str(port),
           "--db", str(tmp / "ledger.db"), "--slots", str(slots), "--max-queue", str(max(64, 4 * slots)),
           "--max-context", str(args.max_context), "--log-level", "warning"]
    if getattr(args, "threads", None):
        cmd += ["--threads", str(args.threads)]
    print(f"starting `ultrafast serve --model {args.model} --slots {slots}` on port {port} (log {log})",
          file=sys.stderr)
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, 900, log)
        yield url + "/v1", _model(url, None)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
