"""A real `ultrafast serve` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

EXE = [sys.executable, "-m", "ultrafast.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, db: str, log: Path, *extra: str, port: int | None = None):
        self.model, self.db, self.log_path, self.extra = model, db, log, list(extra)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 240) -> "ServerProcess":
        cmd = EXE + ["serve", "--model", str(self.model), "--port", str(self.port), "--db", str(self.db),
                     "--log-level", "warning"] + self.extra
        self._log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"server did not come up in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, no chance to clean up."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20) -> int | None:
        """SIGTERM (graceful), then SIGKILL if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory, smollm_path):
    """start(db, *extra_args) -> a running ServerProcess on the SmolLM2 model; all stopped at module end."""
    started: list[ServerProcess] = []
    tmp = tmp_path_factory.mktemp("server")

    def start(db: str | None = None, *extra: str, port: int | None = None) -> ServerProcess:
        db = db or str(tmp / "ledger.db")
        srv = ServerProcess(smollm_path, db, tmp / f"server{len(started)}.log", *extra, port=port)
        started.append(srv)
        return srv.start()

    start.tmp = tmp
    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def qwen05_server(tmp_path_factory, qwen05_path):
    """Qwen2.5-Coder-0.5B served (its template has tools), shared by the tool-call tests of every module."""
    tmp = tmp_path_factory.mktemp("qwen05")
    srv = ServerProcess(qwen05_path, str(tmp / "ledger.db"), tmp / "server.log").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def qwen15_server(tmp_path_factory):
    """`ultrafast serve --model qwen2.5-coder-1.5b`, what the agent clients are tested against."""
    from ultrafast.pull import pull

    tmp = tmp_path_factory.mktemp("qwen15")
    srv = ServerProcess(pull("qwen2.5-coder-1.5b"), str(tmp / "ledger.db"), tmp / "server.log").start()
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------ PostgreSQL


def unavailable(why: str, required_by: str):
    """Skip, or fail where the environment variable `required_by` says the thing is required (CI)."""
    if os.environ.get(required_by):
        pytest.fail(f"required here (${required_by}) but unavailable: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server's URL: $ULTRAFAST_TEST_POSTGRES_URL (CI: `.ci/run` starts one), or a throwaway cluster
    from the local binaries (`LocalPostgres`). Skipped without either, unless $ULTRAFAST_REQUIRE_POSTGRES."""
    pytest.importorskip("psycopg")
    url = os.environ.get("ULTRAFAST_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    from ultrafast.server.cluster import LocalPostgres

    try:
        pg = LocalPostgres().start()
    except RuntimeError as e:
        unavailable(str(e), "ULTRAFAST_REQUIRE_POSTGRES")
    try:
        yield pg.url
    finally:
        pg.stop()


@pytest.fixture
def pg_url(pg_server):
    """A fresh database on the server, for one test."""
    import uuid

    import psycopg

    name = "uf_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    base, _, query = pg_server.partition("?")
    yield base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
