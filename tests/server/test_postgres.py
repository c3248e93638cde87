"""The PostgreSQL backend (psycopg 3): keys, ledger and usage, and a server writing its ledger there.

Uses $ULTRAFAST_TEST_POSTGRES_URL when set (CI: `.ci/run` installs Debian's PostgreSQL and starts a cluster);
otherwise starts a throwaway cluster with the local PostgreSQL binaries (initdb/pg_ctl, as the `postgres` user
when run as root) on a Unix socket. Skipped when neither is available, unless $ULTRAFAST_REQUIRE_POSTGRES is
set (CI), where that is a failure."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid

import openai
import pytest

psycopg = pytest.importorskip("psycopg")


def _unavailable(why: str):
    if os.environ.get("ULTRAFAST_REQUIRE_POSTGRES"):
        pytest.fail(f"PostgreSQL is required here ($ULTRAFAST_REQUIRE_POSTGRES) but unavailable: {why}")
    pytest.skip(why)

from ultrafast.server import ledger as ledger_mod  # noqa: E402
from ultrafast.server.auth import KeyStore  # noqa: E402
from ultrafast.server.db import Database  # noqa: E402
from ultrafast.server.errors import AuthError  # noqa: E402
from ultrafast.server.ledger import LedgerRow, LedgerWriter  # noqa: E402

from .conftest import free_port  # noqa: E402


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return cands[-1] if cands else None


@pytest.fixture(scope="module")
def pg_server():
    url = os.environ.get("ULTRAFAST_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        _unavailable("no PostgreSQL server binaries (initdb, pg_ctl) and no $ULTRAFAST_TEST_POSTGRES_URL")
    prefix: list[str] = []
    d = tempfile.mkdtemp(prefix="ultrafast-pg-")
    if os.geteuid() == 0:  # postgres refuses to run as root
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("running as root and there is no postgres user")
        runuser = shutil.which("runuser")
        if not runuser:
            _unavailable("running as root without runuser")
        os.chown(d, pw.pw_uid, pw.pw_gid)
        prefix = [runuser, "-u", "postgres", "--"]
    os.chmod(d, 0o755)
    data, port = os.path.join(d, "data"), free_port()
    p = subprocess.run(prefix + [initdb, "-D", data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        shutil.rmtree(d, ignore_errors=True)
        _unavailable(f"initdb failed: {p.stderr[-500:]}")
    opts = f"-p {port} -k {d} -c listen_addresses='' -c fsync=off"
    p = subprocess.run(prefix + [pg_ctl, "-D", data, "-o", opts, "-l", os.path.join(d, "log"), "-w", "start"],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        shutil.rmtree(d, ignore_errors=True)
        _unavailable(f"pg_ctl start failed: {p.stderr[-500:]}")
    try:
        yield f"postgresql://postgres@/postgres?host={d}&port={port}"
    finally:
        subprocess.run(prefix + [pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server):
    """A fresh database on the server, for one test."""
    name = "uf_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    base, _, query = pg_server.partition("?")
    yield base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")


def test_keys_ledger_usage_on_postgres(pg_url):
    db = Database(pg_url).init()
    assert db.kind == "postgres" and "postgres@" not in db.describe()
    store = KeyStore(db)
    secret, rec = store.create("pg-user", "standard,ultrafast", tpm=500)
    assert store.verify(secret).tpm == 500
    w = LedgerWriter(db)
    for i, tier in enumerate(["standard", "ultrafast", "ultrafast"]):
        row = LedgerRow(request_id=f"r{i}", key_id=rec["key_id"], model="m", tier=tier, endpoint="chat.completions",
                        prompt_tokens=10, cached_tokens=2, completion_tokens=5, cost_usd=0.5, queue_s=0.0,
                        total_s=0.1, status="finished", tau=1.5 if tier == "ultrafast" else None)
        assert w.submit(row).result(10)
    w.close()
    rep = ledger_mod.usage(db, key_id=rec["key_id"], all_keys=False)
    assert {(r["tier"], r["requests"]) for r in rep} == {("standard", 1), ("ultrafast", 2)}
    assert all(r["key_name"] == "pg-user" for r in rep) and sum(r["cost_usd"] for r in rep) == pytest.approx(1.5)
    store.revoke(rec["key_id"])
    with pytest.raises(AuthError):
        store.verify(secret)
    db.close()


def test_server_ledger_on_postgres(pg_url, server_factory):
    srv = server_factory(pg_url, "--max-context", "512", "--no-warmup")
    c = openai.OpenAI(base_url=srv.base_url, api_key="local", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4,
                                  temperature=0)
    db = Database(pg_url)
    deadline = time.monotonic() + 5
    rows = []
    while not rows and time.monotonic() < deadline:
        rows = db.query("SELECT * FROM ledger WHERE request_id = ?", (r.id,))
    assert rows and rows[0]["status"] == "finished" and rows[0]["completion_tokens"] == r.usage.completion_tokens
    assert rows[0]["prompt_tokens"] == r.usage.prompt_tokens
    # the Responses API keeps its conversations there: a continuation reads the stored turn back
    first = c.responses.create(model="smollm2-135m", input="Hi!", max_output_tokens=4, temperature=0)
    more = c.responses.create(model="smollm2-135m", input="Again.", previous_response_id=first.id,
                              max_output_tokens=4, temperature=0)
    assert more.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    stored = db.query("SELECT response FROM responses WHERE response_id = ?", (more.id,))
    assert json.loads(stored[0]["response"])["previous_response_id"] == first.id
    assert db.query("SELECT endpoint FROM ledger WHERE request_id = ?", (more.id,))[0]["endpoint"] == "responses"
    db.close()


def test_ledger_rows_settle_close_and_interrupt_on_postgres(pg_url):
    db = Database(pg_url).init()
    w = LedgerWriter(db)
    row = LedgerRow(request_id="live", key_id=None, model="m", tier="standard", endpoint="completions",
                    prompt_tokens=3, cached_tokens=0, completion_tokens=0, cost_usd=0.1, queue_s=0.0, total_s=0.1,
                    status="running")
    assert w.submit(row).result(10)
    row.completion_tokens, row.status = 40, "finished"
    assert w.submit(row).result(10)
    row.status = "running"
    with pytest.raises(ValueError, match="already closed"):
        w.submit(row).result(10)
    dead = LedgerRow(request_id="dead", key_id=None, model="m", tier="standard", endpoint="completions",
                     prompt_tokens=3, cached_tokens=0, completion_tokens=16, cost_usd=0.1, queue_s=0.0, total_s=0.1,
                     status="running", updated_ts=time.time() - 2 * ledger_mod.STALE_S, instance="elsewhere/1/x")
    ledger_mod.write_row(db, dead)
    assert ledger_mod.interrupt_abandoned(db, w.instance) == 1
    got = {r["request_id"]: (r["status"], r["completion_tokens"]) for r in ledger_mod.rows(db)}
    assert got == {"live": ("finished", 40), "dead": ("interrupted", 16)}
    w.close()
    db.close()
