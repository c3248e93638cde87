"""A real `ultrafast serve` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ultrafast.server.process import ServeProcess, free_port  # noqa: F401 (free_port: for the tests)

EXE = [sys.executable, "-m", "ultrafast.cli"]


class ServerProcess(ServeProcess):
    """`ultrafast serve --model M --db DB EXTRA...` on a free loopback port (ultrafast.server.process)."""

    def __init__(self, model: Path, db: str, log: Path, *extra: str, port: int | None = None):
        self.model, self.db = model, db
        super().__init__(["--model", str(model), "--db", str(db), "--log-level", "warning", *extra], log, port)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 240) -> "ServerProcess":
        super().start(timeout)
        return self


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
