"""The PostgreSQL backend (psycopg 3): keys, ledger and usage, and a server writing its ledger there.

The server comes from the `pg_server` fixture (conftest.py): $ULTRAFAST_TEST_POSTGRES_URL, or a throwaway
cluster; skipped without either, unless $ULTRAFAST_REQUIRE_POSTGRES is set (CI)."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from ultrafast.server import ledger as ledger_mod
from ultrafast.server.auth import KeyStore, Principal
from ultrafast.server.db import Database
from ultrafast.server.errors import AuthError, RateLimited
from ultrafast.server.ledger import LedgerRow, LedgerWriter
from ultrafast.server.rate_limit import RateLimiter


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


def test_rate_limit_holds_across_replicas_on_postgres(pg_url):
    """Two limiters on one database (two replicas' worth), 16 threads admitting 10-token prompts for one key at
    once: exactly the limit's worth get in, not twice it."""
    limiters = [RateLimiter(Database(pg_url)), RateLimiter(Database(pg_url))]
    key = Principal("k1", "n", frozenset({"standard"}), tpm=55)
    admitted, refused = [], []
    start = threading.Barrier(16)

    def go(i):
        start.wait()
        try:
            admitted.append(limiters[i % 2].admit(key, 10))
        except RateLimited:
            refused.append(i)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 5 and len(refused) == 11
    limiters[1].refund(key, admitted[0])  # the other replica's reservation, refunded through this one
    limiters[0].admit(key, 10)
    limiters[1].record(key, 5)  # a completion: 55 used
    with pytest.raises(RateLimited):
        limiters[0].admit(key, 1)
    for rl in limiters:
        rl.db.close()
