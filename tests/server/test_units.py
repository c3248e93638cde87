"""Prices, keys, rate limits, the ledger and the scheduler's policy, without a server or a real model."""

from __future__ import annotations

import json
import sqlite3
import os
import threading
import time
from functools import partial
from unittest import mock

import pytest
import torch

from ultrafast.engine import GenerationResult, StreamEvent
from ultrafast.kv_cache import KVCache
from ultrafast.sampler import SamplingParams
from ultrafast.server import ledger as ledger_mod
from ultrafast.server.auth import (LOCAL_USER, KeyStore, Principal, bearer_token, is_loopback,
                                   parse_tiers, resolve_tier)
from ultrafast.server.db import Database
from ultrafast.server.errors import AuthError, InvalidRequest, QueueFull, RateLimited, TierNotEntitled
from ultrafast.server.ledger import LedgerRow, LedgerWriter
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.pricing import PriceTable
from ultrafast.server.rate_limit import RateLimiter
from ultrafast.server.scheduler import GenRequest, ModelWorker, _shared_prompts

# ------------------------------------------------------------------------------------ pricing


def test_builtin_prices_and_multiplier():
    t = PriceTable.builtin()
    std, uf = t.price("qwen2.5-coder-1.5b", "standard"), t.price("qwen2.5-coder-1.5b", "ultrafast")
    assert uf.input == pytest.approx(6 * std.input) and uf.output == pytest.approx(6 * std.output)
    assert std.cached_input == pytest.approx(std.input / 2)
    assert t.price("some-other-model", "standard") == t.default
    # (prompt - cached) * input + cached * cached_input + completion * output, per million
    assert t.cost("qwen2.5-coder-1.5b", "standard", 1_000_000, 0, 0) == pytest.approx(std.input)
    assert t.cost("qwen2.5-coder-1.5b", "standard", 100, 40, 10) == pytest.approx(
        (60 * std.input + 40 * std.cached_input + 10 * std.output) / 1e6)
    assert t.cost("qwen2.5-coder-1.5b", "ultrafast", 100, 40, 10) == pytest.approx(
        6 * t.cost("qwen2.5-coder-1.5b", "standard", 100, 40, 10))
    with pytest.raises(ValueError):
        t.price("m", "gold")
    # the price list (/v1/models) shows 6 x 0.1 as 0.6, not 0.6000000000000001
    assert uf.input != 0.6 and uf.to_json() == {"input": 0.6, "cached_input": 0.3, "output": 2.4}


def test_prices_from_toml_and_json(tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text('ultrafast_multiplier = 4\n[default]\ninput = 1\noutput = 2\n'
                    '[models.m1]\ninput = 0.5\noutput = 1.0\ncached_input = 0.1\n'
                    '[models.m1.ultrafast]\ninput = 3\noutput = 5\n')
    t = PriceTable.load(toml)
    assert t.price("m1", "standard").cached_input == 0.1
    assert t.price("m1", "ultrafast").input == 3 and t.price("m1", "ultrafast").output == 5
    assert t.price("m2", "ultrafast").output == pytest.approx(8)
    js = tmp_path / "p.json"
    js.write_text(json.dumps({"default": {"input": 1, "output": 1}, "models": {"m": {"input": 2, "output": 3}}}))
    t = PriceTable.load(js)
    assert t.multiplier == 6 and t.price("m", "ultrafast").output == pytest.approx(18)


@pytest.mark.parametrize("text, msg", [
    ("[default]\ninput = -1\noutput = 1\n", "non-negative"),
    ("[default]\ninput = 1\n", "needs 'output'"),
    ("colour = 1\n", "unknown top-level"),
    ("{not json", "not valid JSON"),
    ("[default\n", "not valid TOML"),
    ('[models.m]\ninput = "cheap"\noutput = 1\n', "non-negative number"),
])
def test_bad_price_files(tmp_path, text, msg):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=msg):
        PriceTable.load(f)
    with pytest.raises(ValueError, match="cannot read"):
        PriceTable.load(tmp_path / "missing.toml")


# ------------------------------------------------------------------------------------ keys and tiers


def test_keys_hashed_verified_revoked(tmp_path):
    db_path = tmp_path / "k.db"
    store = KeyStore(Database(db_path))
    secret, rec = store.create("alice", "standard,ultrafast", tpm=1000)
    assert secret.startswith(f"uf-{rec['key_id']}-") and rec["tiers"] == ["standard", "ultrafast"]
    p = store.verify(secret)
    assert p.key_id == rec["key_id"] and p.tiers == {"standard", "ultrafast"} and p.tpm == 1000
    raw = sqlite3.connect(db_path).execute("SELECT * FROM api_keys").fetchall()
    assert secret not in repr(raw) and secret.split("-", 2)[2] not in repr(raw)  # only the hash is stored
    for bad in (secret + "x", secret[:-1], "uf-" + rec["key_id"], "sk-123", "", f"uf-nope-{secret[-10:]}"):
        with pytest.raises(AuthError):
            store.verify(bad)
    store.revoke(rec["key_id"])
    with pytest.raises(AuthError, match="revoked"):
        store.verify(secret)
    assert store.list()[0]["status"] == "revoked"
    with pytest.raises(ValueError):
        store.revoke("nonexistent")
    with pytest.raises(ValueError):
        store.create("bob", "gold")
    with pytest.raises(ValueError):
        store.create("", "standard")


def test_tiers_and_helpers():
    std = Principal("k1", "n", frozenset({"standard"}))
    both = Principal("k2", "n", frozenset({"standard", "ultrafast"}))
    assert resolve_tier(None, std) == "standard" and resolve_tier("auto", std) == "standard"
    assert resolve_tier("auto", both) == "ultrafast" and resolve_tier("ultrafast", both) == "ultrafast"
    assert resolve_tier("auto", LOCAL_USER) == "ultrafast"
    with pytest.raises(TierNotEntitled, match="sold separately"):
        resolve_tier("ultrafast", std)
    with pytest.raises(InvalidRequest):
        resolve_tier("gold", both)
    assert parse_tiers("ultrafast, standard") == ["standard", "ultrafast"]
    with pytest.raises(ValueError):
        parse_tiers("")
    assert bearer_token("Bearer abc") == "abc" and bearer_token("Basic abc") is None and bearer_token(None) is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.com")


def test_rate_limiter_window_retry_after_refund(tmp_path):
    now = [1000.0]
    rl = RateLimiter(Database(tmp_path / "rl.db"), clock=lambda: now[0])
    p = Principal("k", "n", frozenset({"standard"}), tpm=100)
    rl.admit(p, 30)
    rl.record(p, 50)  # the completion
    now[0] += 10
    with pytest.raises(RateLimited) as e:
        rl.admit(p, 30)  # 80 used + 30 > 100
    assert e.value.status == 429 and 49 <= e.value.retry_after <= 51  # the first 30 expire at t=1060
    assert e.value.headers()["Retry-After"] in ("49", "50", "51")
    res = rl.admit(p, 20)  # 80 + 20 fits exactly
    rl.refund(p, res)
    rl.admit(p, 20)
    with pytest.raises(RateLimited, match="too large"):
        rl.admit(p, 101)
    now[0] += 61
    rl.admit(p, 90)  # the window has moved on
    rl.admit(Principal("free", "n", frozenset({"standard"})), 10**9)  # no limit on this key
    rl.admit(LOCAL_USER, 10**9)


# ------------------------------------------------------------------------------------ ledger


def _row(i: int, key="k1", tier="standard", status="finished", cost=0.001, ts=None) -> LedgerRow:
    return LedgerRow(request_id=f"r{i}", key_id=key, model="m", tier=tier, endpoint="chat.completions",
                     prompt_tokens=10, cached_tokens=4, completion_tokens=5, cost_usd=cost, queue_s=0.01,
                     total_s=0.5, status=status, ttft_s=0.1, ts=ts or time.time())


def test_ledger_writer_and_usage(tmp_path):
    db = Database(tmp_path / "l.db").init()
    assert db.query("PRAGMA journal_mode")[0]["journal_mode"] == "wal"
    KeyStore(db).db.execute("INSERT INTO api_keys VALUES ('k1', 'alice', 'h', 'standard', NULL, 0, NULL)")
    w = LedgerWriter(db)
    day1 = time.mktime((2025, 3, 1, 12, 0, 0, 0, 0, 0))
    futs = [w.submit(_row(0, ts=day1)), w.submit(_row(1, tier="ultrafast", cost=0.006)),
            w.submit(_row(2, status="cancelled")), w.submit(_row(3, key=None))]
    for f in futs:
        assert f.result(5) is True
    with pytest.raises(Exception):  # the same request id twice is refused: one row per request
        w.submit(_row(0)).result(5)
    w.close()
    rows = ledger_mod.rows(db)
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert rows[0]["day"] == "2025-03-01"
    rep = ledger_mod.usage(db)
    assert sum(r["requests"] for r in rep) == 4
    alice = ledger_mod.usage(db, key_id="k1", all_keys=False)
    assert {(r["tier"], r["requests"], r["cancelled"]) for r in alice if r["day"] != "2025-03-01"} == \
        {("standard", 1, 1), ("ultrafast", 1, 0)}
    assert all(r["key_name"] == "alice" for r in alice)
    local = ledger_mod.usage(db, key_id=None, all_keys=False)
    assert len(local) == 1 and local[0]["key_name"] == "local"
    text = ledger_mod.format_usage(rep)
    assert "alice (k1)" in text and "total: $" in text
    assert ledger_mod.usage(db, since_day="2100-01-01") == []
    with pytest.raises(ValueError):
        ledger_mod.write_row(db, _row(9, status="weird"))


def test_ledger_rows_open_settle_and_close(tmp_path):
    db = Database(tmp_path / "l.db").init()
    w = LedgerWriter(db)
    row = _row(1, status="running")
    assert w.submit(row).result(5)
    for n in (5, 9, 20):  # rewrites while running: the row follows
        row.completion_tokens = n
        assert w.submit(row).result(5)
        assert ledger_mod.rows(db)[0]["completion_tokens"] == n
    row.status, row.completion_tokens = "finished", 25
    assert w.submit(row).result(5)
    got = ledger_mod.rows(db)
    assert len(got) == 1 and (got[0]["status"], got[0]["completion_tokens"]) == ("finished", 25)
    assert got[0]["instance"] == w.instance and got[0]["updated_ts"] >= got[0]["ts"]
    row.status = "running"  # a closed row is never reopened or rewritten
    with pytest.raises(ValueError, match="already closed"):
        w.submit(row).result(5)
    assert ledger_mod.rows(db)[0]["status"] == "finished"
    w.close()


def test_a_future_cancelled_by_its_waiter_does_not_stop_the_writer(tmp_path):
    """A handler whose client went away while it waited on its row's future cancels that future (asyncio's
    wrap_future passes the cancel on). The row is still written, and the writer goes on: it once died on
    setting a cancelled future's result, and every later request of the server waited for ever (CI's soak)."""
    db = Database(tmp_path / "l.db").init()
    w = LedgerWriter(db)
    gate = threading.Event()
    write = ledger_mod.write_row
    with mock.patch.object(ledger_mod, "write_row", lambda d, r: (gate.wait(5), write(d, r))):
        held = w.submit(_row(0))  # the writer waits at the gate on this one ...
        cancelled = [w.submit(_row(i, status=s)) for i, s in ((1, "finished"), (2, "running"))]
        assert all(f.cancel() for f in cancelled + [held])  # ... while their waiters give up on all three
        gate.set()
        after = w.submit(_row(3))
        assert after.result(10) is True
    assert [r["request_id"] for r in ledger_mod.rows(db)] == ["r0", "r1", "r2", "r3"]
    assert w.failed == 0
    w.close()


def test_bookkeeping_after_a_row_runs_on_the_writers_thread_and_a_failing_one_stops_nothing(tmp_path):
    """The scheduler hands a request's rate-limit event to the ledger's thread (`submit(row, then=...)`), so a
    slow database never holds up the thread that decodes. It runs after the row's write, on the writer's
    thread, once per submit (also for rewrites coalesced into one write), before the row's Future is settled (a
    client answered has had its request counted: the limit's "overshoot by one completion, never more"); one
    that raises is logged and the writer goes on."""
    db = Database(tmp_path / "l.db").init()
    w = LedgerWriter(db)
    ran = []

    def then(tag):
        ran.append((tag, threading.current_thread().name, len(ledger_mod.rows(db))))

    def boom():
        raise RuntimeError("bookkeeping failed")

    assert w.submit(_row(0), then=partial(then, "a")).result(5)
    assert ran == [("a", "ultrafast-ledger", 1)]  # done before the row's waiter hears (the client's answer)
    assert w.submit(_row(1), then=boom).result(5)
    assert w.submit(_row(2), then=partial(then, "b")).result(5)
    assert ran == [("a", "ultrafast-ledger", 1), ("b", "ultrafast-ledger", 3)]
    w.close()
    assert [r["request_id"] for r in ledger_mod.rows(db)] == ["r0", "r1", "r2"]


def test_abandoned_running_rows_become_interrupted(tmp_path):
    import subprocess
    import sys

    db = Database(tmp_path / "l.db").init()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = ledger_mod.instance_id().split("/")[0]
    now = time.time()
    rows = {"dead": (f"{host}/{dead.stdout.strip()}/x", now), "stale": ("elsewhere/1/y", now - 2 * ledger_mod.STALE_S),
            "fresh": ("elsewhere/1/z", now), "alive": (f"{host}/{os.getpid()}/other", now)}
    for i, (name, (inst, ts)) in enumerate(rows.items()):
        r = _row(i, status="running")
        r.request_id, r.instance, r.updated_ts = name, inst, ts
        ledger_mod.write_row(db, r)
    mine = ledger_mod.instance_id()
    r = _row(9, status="running")
    r.request_id, r.instance = "mine", mine
    ledger_mod.write_row(db, r)
    assert ledger_mod.interrupt_abandoned(db, mine) == 2
    status = {r["request_id"]: r["status"] for r in ledger_mod.rows(db)}
    assert status == {"dead": "interrupted", "stale": "interrupted", "fresh": "running", "alive": "running",
                      "mine": "running"}
    assert ledger_mod.interrupt_abandoned(db, mine) == 0
    rep = ledger_mod.usage(db)
    assert sum(x["interrupted"] for x in rep) == 2 and sum(x["requests"] for x in rep) == 5


def test_an_older_ledger_gains_the_new_columns(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as c:  # the first schema: no updated_ts, no instance
        c.execute("CREATE TABLE ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL UNIQUE, "
                  "key_id TEXT, model TEXT NOT NULL, tier TEXT NOT NULL, endpoint TEXT NOT NULL, n INTEGER NOT NULL, "
                  "prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
                  "cost_usd REAL NOT NULL, queue_s REAL NOT NULL, ttft_s REAL, total_s REAL NOT NULL, "
                  "decode_tokens_per_s REAL, tau REAL, status TEXT NOT NULL, ts REAL NOT NULL, day TEXT NOT NULL)")
        c.execute("INSERT INTO ledger (request_id, model, tier, endpoint, n, prompt_tokens, cached_tokens, "
                  "completion_tokens, cost_usd, queue_s, total_s, status, ts, day) "
                  "VALUES ('old', 'm', 'standard', 'completions', 1, 3, 0, 4, 0.1, 0, 1, 'finished', 0, '1970-01-01')")
    db = Database(path).init()
    ledger_mod.write_row(db, _row(1))
    assert [r["request_id"] for r in ledger_mod.rows(db)] == ["old", "r1"]


# ------------------------------------------------------------------------------------ scheduler (fake engine)


class FakeCache:
    def __init__(self, n=64):
        self.k = torch.zeros(1, 1, n, 1)
        self.v = torch.zeros(1, 1, n, 1)
        self.tokens: list[int] = []
        self.mirror = None

    reusable_prefix = KVCache.reusable_prefix  # the real rules, on a tiny cache
    copy_rows_from = KVCache.copy_rows_from


class FakeEngine:
    """Yields max_tokens tokens; logs (request tag, event) so tests can see the scheduling order."""

    max_context = 64

    def __init__(self):
        self.cache = FakeCache()
        self.log: list[tuple] = []
        self.closed: list = []
        self.lock = threading.Lock()

    def new_cache(self):
        return FakeCache()

    def stepper(self, tier):
        return None

    def describe(self):
        return {}

    def stream(self, prompt, params, tier="standard", cache=None, scope=None):
        reused = cache.reusable_prefix(prompt)
        tag = prompt[0]
        out = []
        try:
            self.log.append((tag, "prefill", reused))
            cache.k[0, 0, reused:len(prompt)] = torch.tensor(prompt[reused:], dtype=torch.float32)[:, None]
            cache.tokens = cache.tokens[:reused]
            for i in range(params.max_tokens):
                if i:
                    self.log.append((tag, "step"))
                out.append(100 + i)
                yield StreamEvent(100 + i, "x")
        finally:
            cache.tokens = list(prompt) + out
            if len(out) < params.max_tokens:
                self.closed.append(tag)
        return GenerationResult(token_ids=out, text="x" * len(out), prompt_tokens=len(prompt),
                                completion_tokens=len(out), finish_reason="length", ttft_s=0.001, decode_s=0.001,
                                weight_bytes_per_token=1, cached_tokens=reused, tier=tier,
                                spec={"tau": 1.5, "verify_passes": 1, "drafters": {}} if tier == "ultrafast" else {})


def _worker(tmp_path, engine, slots=1, max_queue=8, weight=2):
    db = Database(tmp_path / "s.db").init()
    return ModelWorker("fake", None, slots=slots, max_queue=max_queue, ultrafast_weight=weight,
                       metrics=ServerMetrics(process=False), ledger=LedgerWriter(db), prices=PriceTable.builtin(),
                       limiter=RateLimiter(db), warmup=False, engine_factory=lambda: engine), db


def _run_worker(w, reqs) -> None:
    """Submit reqs, start the worker, wait for every request, stop it."""
    for r in reqs:
        w.submit(r)
    w.start()
    w.wait_ready(10)
    for r in reqs:
        assert r.done.wait(10)
    w.stop()


def _request(prompt, tokens=3, tier="standard", n=1):
    msgs, done = [], threading.Event()

    def emit(m):
        msgs.append(m)
        if m[0] == "done":
            done.set()

    req = GenRequest(model="fake", tier=tier, endpoint="completions", principal=LOCAL_USER, prompts=[prompt],
                     make_params=lambda g, i: SamplingParams(max_tokens=tokens), n=n, emit=emit)
    req.msgs, req.done = msgs, done
    return req


def test_ultrafast_first_and_more_often(tmp_path):
    eng = FakeEngine()
    w, _ = _worker(tmp_path, eng, slots=2)
    a, b, u = _request([1, 9], 6), _request([2, 9], 6), _request([3, 9], 6, tier="ultrafast")
    for r in (a, b, u):
        w.submit(r)
    with pytest.raises(QueueFull):
        for i in range(10):
            w.submit(_request([50 + i, 9]))
    w.start()
    w.wait_ready(10)
    for r in (a, b, u):
        assert r.done.wait(10)
    w.stop()
    order = [tag for tag, *_ in eng.log]
    assert order[0] == 3 and eng.log[0][1] == "prefill"  # the ultrafast request is admitted first
    assert order.index(1) < order.index(2)  # then the standard ones, first come first served
    # two steps per round for ultrafast: it ends well before the standard one it ran beside
    assert max(i for i, t in enumerate(order) if t == 3) < max(i for i, t in enumerate(order) if t == 1)
    assert order[:6] == [3, 3, 1, 3, 3, 1]


def test_ultrafast_load_does_not_starve_the_standard_tier(tmp_path):
    """Six ultrafast requests and one standard one for 4 slots: ultrafast may hold 3 while standard waits, so
    the standard request is admitted in the first round (a soak saw strict priority starve it for 10 min)."""
    def run(reqs, tmp):
        eng = FakeEngine()
        _run_worker(_worker(tmp, eng, slots=4)[0], reqs)
        return eng

    eng = run([_request([10 + i, 9], 6, tier="ultrafast") for i in range(6)] + [_request([1, 9], 6)], tmp_path)
    prefills = [tag for tag, what, *_ in eng.log if what == "prefill"]
    assert 1 in prefills[:4] and sorted(prefills[:4]) == [1, 10, 11, 12]
    # with no standard request waiting, ultrafast takes every slot
    eng2 = run([_request([10 + i, 9], 4, tier="ultrafast") for i in range(4)], tmp_path / "b")
    first_round = [tag for tag, what, *_ in eng2.log[:8] if what == "prefill"]  # each: prefill, then a step
    assert sorted(first_round) == [10, 11, 12, 13]  # all four admitted at once


class GatedEngine(FakeEngine):
    """FakeEngine whose request tagged 1 stops at its first token until `gate` is set (the worker is busy)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def stream(self, prompt, params, tier="standard", cache=None, scope=None):
        inner, i = super().stream(prompt, params, tier, cache), 0
        while True:
            try:
                ev = next(inner)
            except StopIteration as done:
                return done.value
            if prompt[0] == 1 and i == 1:
                self.gate.wait(10)
            yield ev
            i += 1


def test_queue_counts_only_requests_beyond_free_slots(tmp_path):
    """2 slots, queue of 1: with one slot busy, a burst gets the free slot plus the queue; the next is refused."""
    eng = GatedEngine()
    w, _ = _worker(tmp_path, eng, slots=2, max_queue=1)
    w.start()
    w.wait_ready(10)
    a = _request([1, 9], 4)
    w.submit(a)
    while not a.msgs:  # a has its first token; the worker now waits inside a's second step
        time.sleep(0.01)
    b, c = _request([2, 9], 2), _request([3, 9], 2)
    w.submit(b)  # takes the free slot at the next round: not waiting
    w.submit(c)  # waits: the queue of 1 is full
    with pytest.raises(QueueFull):
        w.submit(_request([4, 9], 2))
    eng.gate.set()
    for r in (a, b, c):
        assert r.done.wait(10) and r.msgs[-1][1]["status"] == "finished"
    w.submit(d := _request([4, 9], 2))  # room again once they are done
    assert d.done.wait(10)
    w.stop()


def test_longest_prefix_slot_and_cancel(tmp_path):
    eng = FakeEngine()
    w, db = _worker(tmp_path, eng, slots=2)
    w.start()
    w.wait_ready(10)
    w.slots[0].cache.tokens = [7, 1, 1, 1]
    w.slots[1].cache.tokens = [7, 8, 9, 10]
    r = _request([7, 8, 9, 10, 11], 2)
    w.submit(r)
    assert r.done.wait(10)
    assert eng.log[0] == (7, "prefill", 4)
    summary = r.msgs[-1][1]
    assert summary["cached_tokens"] == 4 and summary["status"] == "finished"
    # cancel a long one: generator closed, slot freed, one ledger row "cancelled"
    long = _request([5, 5, 5], 10_000)
    w.submit(long)
    while not any(t == 5 for t, *_ in eng.log):
        time.sleep(0.01)
    w.cancel(long)
    assert long.done.wait(10)
    assert eng.closed == [5] and all(s.owner is None for s in w.slots)
    w.stop()
    w.ledger.close()
    rows = ledger_mod.rows(db)
    assert [(r["request_id"], r["status"]) for r in rows] == [(r.id, "finished"), (long.id, "cancelled")]
    assert 0 < rows[1]["completion_tokens"] < 10_000


def test_n_candidates_copy_the_prefill(tmp_path):
    eng = FakeEngine()
    w, _ = _worker(tmp_path, eng, slots=3)
    w.start()
    w.wait_ready(10)
    prompt = [4, 11, 12, 13, 14, 15]
    r = _request(prompt, 3, n=3)
    w.submit(r)
    assert r.done.wait(10)
    w.stop()
    prefills = [e for e in eng.log if e[1] == "prefill"]
    # the first candidate computes the prompt; the two siblings find its rows already copied in
    assert prefills == [(4, "prefill", 0), (4, "prefill", 5), (4, "prefill", 5)]
    assert all(torch.equal(s.cache.k[0, 0, :5, 0], torch.tensor(prompt[:5], dtype=torch.float32)) for s in w.slots)
    done = [m for m in r.msgs if m[0] == "choice_done"]
    assert sorted(m[1] for m in done) == [0, 1, 2]
    assert r.msgs[-1][1]["prompt_tokens"] == len(prompt) and r.msgs[-1][1]["completion_tokens"] == 9


def test_keys_required_off_loopback():
    from ultrafast.server.app import ServerConfig, model_name

    assert not ServerConfig(models=[], host="127.0.0.1").keys_required
    assert ServerConfig(models=[], host="127.0.0.1", require_keys=True).keys_required
    assert ServerConfig(models=[], host="0.0.0.0").keys_required
    assert model_name("smollm2-135m") == "smollm2-135m" and model_name("/x/y/My-Model.Q4.gguf") == "My-Model.Q4"
    assert model_name("/models/hf-folder") == "hf-folder"


def test_model_name_of_a_folder(tmp_path):
    from ultrafast.server.app import model_name

    d = tmp_path / "Qwen2.5-Coder-0.5B"
    d.mkdir()
    assert model_name(str(d)) == "Qwen2.5-Coder-0.5B"


class _Tok:
    eos_ids = frozenset()
    chat_template = None

    def token_str(self, i):
        return "x"


class BrokenEngine(FakeEngine):
    """Loads, tokenizes, then fails inside generation: the server must answer 500 in OpenAI's shape,
    keep serving, and bill the request as failed."""

    tokenizer = _Tok()

    class config:
        vocab_size = 1000

    def chat_prompt(self, messages, tools=None):
        return [1, 2, 3]

    def raw_prompt(self, text):
        return [1, 2]

    def stream(self, prompt, params, tier="standard", cache=None, scope=None):
        if prompt == [1, 2, 3]:
            raise RuntimeError("boom")
        return (yield from super().stream(prompt, params, tier, cache))


def test_internal_error_is_500_and_billed_as_failed(tmp_path):
    from fastapi.testclient import TestClient

    from ultrafast.server.app import ServerConfig, create_app

    db = tmp_path / "e.db"
    app = create_app(ServerConfig(models=[("fake", None)], db=str(db), warmup=False,
                                  engine_factories={"fake": BrokenEngine}))
    with TestClient(app) as tc:
        r = tc.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "boom" in err["message"] and err["code"] == "generation_failed"
        with tc.stream("POST", "/v1/chat/completions", json={"model": "fake", "stream": True,
                                                              "messages": [{"role": "user", "content": "x"}]}) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert "boom" in lines[-2] and lines[-1] == "data: [DONE]"
        ok = tc.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xxx"
    rows = sqlite3.connect(db).execute("SELECT status FROM ledger ORDER BY id").fetchall()
    assert rows == [("failed",), ("failed",), ("finished",)]


class FakeGeneration:
    """The Generation interface (prefill / plain_input / advance / take_events / done / result / close)."""

    def __init__(self, engine, prompt, params, tier, cache):
        self.engine, self.prompt, self.params, self.tier, self.cache = engine, prompt, params, tier, cache
        self.sampler = None
        self.out, self.events, self.done, self.result = [], [], False, None

    def prefill(self):
        self.engine.log.append((self.prompt[0], "prefill"))
        self._emit()

    def plain_input(self):
        return [self.out[-1]], len(self.prompt) + len(self.out) - 1, self.cache

    def advance(self, logits=None, features=None):
        self.engine.log.append((self.prompt[0], "batched" if logits is not None else "own"))
        self._emit()

    def _emit(self):
        self.out.append(100 + len(self.out))
        self.events.append(StreamEvent(self.out[-1], "y"))
        if len(self.out) == self.params.max_tokens:
            self.done = True
            self.result = GenerationResult(token_ids=list(self.out), text="y" * len(self.out),
                                           prompt_tokens=len(self.prompt), completion_tokens=len(self.out),
                                           finish_reason="length", ttft_s=0.001, decode_s=0.001,
                                           weight_bytes_per_token=1, tier=self.tier)

    def take_events(self):
        ev, self.events = self.events, []
        return ev

    def close(self):
        pass


class BatchingEngine(FakeEngine):
    def __init__(self):
        super().__init__()
        self.batches: list[int] = []

    def start(self, prompt, params, tier="standard", cache=None, scope=None):
        return FakeGeneration(self, prompt, params, tier, cache)

    def forward_batch(self, seqs, hidden=False, share=None, all_logits=False):
        self.batches.append(len(seqs))
        return torch.zeros(sum(len(t) for t, _, _ in seqs) if all_logits else len(seqs), 4)


def test_standard_steps_are_batched(tmp_path):
    eng = BatchingEngine()
    w, _ = _worker(tmp_path, eng, slots=4)
    reqs = [_request([i, 9], 5) for i in (1, 2, 3)] + [_request([4, 9], 5, tier="ultrafast")]
    _run_worker(w, reqs)
    assert all(r.msgs[-1][1]["completion_tokens"] == 5 for r in reqs)
    # the three standard requests share one pass per round; the ultrafast one steps on its own
    assert eng.batches == [3, 3, 3, 3]
    assert [e for e in eng.log if e[0] == 4].count((4, "own")) == 4
    assert not any(e[1] == "own" for e in eng.log if e[0] != 4)


def test_ultrafast_candidates_with_a_draft_head_decode_together(tmp_path, tiny_head, smollm_path):
    """Ultrafast requests whose drafter reads the target's features (a draft head) share batched plain passes
    too: the pass returns the features and each row goes to its candidate's head, which keeps its context
    (the SmolLM2 suite's ultrafast requests used to speculate alone while the standard tier's shared passes).
    Their texts stay the standard tier's."""
    from ultrafast.engine import Engine

    engine = Engine.from_path(smollm_path, max_context=512)
    engine.attach_draft_head(tiny_head[1])
    # a verify cost under which three rows in one pass (3 tokens for 1.3 steps) beat any request's own drafts
    engine.r_table = [0.0, 1.0] + [1.0 + 0.15 * (k - 1) for k in range(2, 18)]
    calls, fed = [], []
    forward_batch = engine.forward_batch

    def spy(seqs, hidden=False, share=None, all_logits=False):
        calls.append(hidden)
        return forward_batch(seqs, hidden=hidden, share=share, all_logits=all_logits)

    engine.forward_batch = spy
    w, _ = _worker(tmp_path, engine, slots=3, weight=2)
    questions = ["Name three rivers of Europe.", "What is a prime number?", "Write a haiku about the sea."]
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    reqs = []
    for ids in prompts:
        r = _request(ids, 24, tier="ultrafast")
        r.model = "fake"
        reqs.append(r)
    observe = type(engine.stepper("ultrafast")).observe

    def watch(self, start_pos, features, tokens_after):
        fed.append((start_pos, features.shape[0], len(tokens_after)))
        return observe(self, start_pos, features, tokens_after)

    with mock.patch.object(type(engine.stepper("ultrafast")), "observe", watch):
        _run_worker(w, reqs)
    for r, ids in zip(reqs, prompts):
        text = "".join(m[2] for m in r.msgs if m[0] == "delta")
        assert text == engine.generate(ids, SamplingParams(max_tokens=24)).text
    assert True in calls  # batched passes asked for the features the head reads ...
    assert w.metrics.batched_rows.labels("fake", "ultrafast")._value.get() > 0
    assert sum(1 for _, rows, toks in fed if rows == 1 and toks == 1) > 0  # ... and handed each row over


def test_ultrafast_requests_verify_their_drafts_in_a_shared_pass(tmp_path, smollm_path):
    """Ultrafast requests that decode together add their lookups' drafts to the shared pass where the rows pay
    for themselves (`speculative.share_rows`), each verifying its own rows: greedy and seeded sampled texts
    stay the standard tier's, and the pass carries more rows than requests."""
    from ultrafast.engine import Engine

    engine = Engine.from_path(smollm_path, max_context=512)
    # rows nearly free up to 8 (so the batch pays, and so do drafts that are often right), dearer beyond
    engine.r_table = [0.0, 1.0] + [1.0 + 0.03 * (k - 1) if k <= 8 else 1.2 + 0.3 * (k - 8) for k in range(2, 18)]
    passes = []
    forward_batch = engine.forward_batch

    def spy(seqs, hidden=False, share=None, all_logits=False):
        passes.append((len(seqs), sum(len(t) for t, _, _ in seqs), share is not None))
        return forward_batch(seqs, hidden=hidden, share=share, all_logits=all_logits)

    engine.forward_batch = spy
    w, _ = _worker(tmp_path, engine, slots=3, weight=2)
    items = "apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum"
    asks = [f"Repeat this list exactly, twice: {items}", f"Write this list backwards and then forwards: {items}",
            f"Copy this line three times: {items}"]
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40),
              SamplingParams(max_tokens=40, temperature=0.8, seed=11)]
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in asks]
    reqs = []
    for ids, p in zip(prompts, params):
        r = _request(ids, 40, tier="ultrafast")
        r.candidates[0].params = p
        reqs.append(r)
    # and best-of-n siblings, which also share their prompt's rows in the pass (`_shared_prompts`)
    sib = [SamplingParams(max_tokens=40, temperature=0.8, seed=100 + i) for i in range(3)]
    best = _request(prompts[0], 40, tier="ultrafast", n=3)
    for c, p in zip(best.candidates, sib):
        c.params = p
    _run_worker(w, reqs + [best])
    for r, ids, p in zip(reqs, prompts, params):
        text = "".join(m[2] for m in r.msgs if m[0] == "delta")
        assert text == engine.generate(ids, p).text
    for i, p in enumerate(sib):
        text = "".join(m[2] for m in best.msgs if m[0] == "delta" and m[1] == i)
        assert text == engine.generate(prompts[0], p).text
    shared = [(n, rows, share) for n, rows, share in passes if n > 1]
    assert any(rows > n for n, rows, _ in shared), passes  # drafts rode along in shared passes,
    assert any(rows > n and share for n, rows, share in shared), passes  # also beside shared prompt rows


def test_a_requests_ultrafast_candidates_prefill_then_batch(tmp_path):
    """The n candidates of an ultrafast request are all fresh in its first round: each prefills and waits for
    the batched passes of the next round, instead of spending the rest of its round speculating alone (n = 10
    on the 1.5B: ten candidates' three lone passes each before the first batched pass)."""

    class SteppedGeneration(FakeGeneration):
        stepper = mock.Mock(wants_hidden=False, stats=mock.Mock(emitted=0, spent=0.0))

    class Engine(BatchingEngine):
        r_table = [0.0, 1.0] + [1.0 + 0.1 * (k - 1) for k in range(2, 18)]

        def start(self, prompt, params, tier="standard", cache=None, scope=None):
            return SteppedGeneration(self, prompt, params, tier, cache)

    eng = Engine()
    w, _ = _worker(tmp_path, eng, slots=3, weight=2)
    req = _request([7, 9], 5, tier="ultrafast", n=3)
    _run_worker(w, [req])
    assert req.msgs[-1][1]["completion_tokens"] == 15
    assert [e[1] for e in eng.log].count("prefill") == 3
    assert not any(e[1] == "own" for e in eng.log), (eng.log, eng.batches)  # prefill, then only batched passes
    assert eng.batches == [3, 3, 3, 3]


def _probe_candidate():
    return mock.Mock(batched_rounds=0, probed=False, probe_won=False, spec_rate=1.0)


def test_batched_candidates_probe_on_one_clock_that_backs_off(tmp_path):
    """Batched ultrafast candidates speculate alone now and then (a probe), one at a time: the group probes once
    per 8 rounds at first, and a probe whose drafts yield less than the batched pass doubles the wait (8, 16,
    ... up to 64 rounds). Ten candidates of one request (n = 10) probe twice in 40 rounds, not ten times in a
    row from round 8 as when each kept its own clock."""
    w, _ = _worker(tmp_path, FakeEngine())
    group = [_probe_candidate() for _ in range(10)]
    probes = []
    for rnd in range(1, 41):
        c = w._probe(group)
        if c is not None:
            probes.append((rnd, group.index(c)))
            w._probed(c, batch_rate=2.5)  # its drafts gave 1.0 token per step-time against the batch's 2.5
    assert probes == [(8, 0), (24, 1)]  # never-probed candidates first; waits of 8, then 16
    assert w._probe_wait == 32 and group[0].probed and not group[0].probe_won
    for _ in range(3):
        w._since_probe = w._probe_wait
        w._probed(w._probe(group), batch_rate=2.5)
    assert w._probe_wait == 64  # 32, 64, and no further


def test_a_probe_that_beats_the_batch_brings_the_wait_back(tmp_path):
    """A probe whose drafts yield more than the batched pass (text that repeats) sets the wait back to 8 rounds
    and that candidate goes first at the next probe; a newcomer to the batch also sets it back to 8."""
    w, _ = _worker(tmp_path, FakeEngine())
    a, b = _probe_candidate(), _probe_candidate()
    w._probe_wait = 64
    picks = [w._probe([a, b]) for _ in range(8)]  # newcomers: their drafts are measured within 8 rounds
    assert picks[:7] == [None] * 7 and picks[7] is a
    a.spec_rate = 3.0
    w._probed(a, batch_rate=2.5)
    assert a.probe_won and w._probe_wait == 8
    picks = [w._probe([a, b]) for _ in range(8)]
    assert picks[:7] == [None] * 7 and picks[7] is a  # the winner again, before b who was never probed
    a.spec_rate = 1.0
    w._probed(a, batch_rate=2.5)
    assert w._probe_wait == 16 and not a.probe_won
    c = _probe_candidate()
    assert w._probe([a, b, c]) is None and w._probe_wait == 8


def test_worker_builds_its_engine_with_the_activation_bits(tmp_path, smollm_path):
    """`serve --activation-bits 8` reaches the engine the worker loads (both tiers share it)."""
    import ultrafast.kernels as uk

    if not uk.linear_path(uk.Q4_1, 8):
        pytest.skip("no integer kernels for 8-bit activations on this CPU")
    db = Database(tmp_path / "s.db").init()
    w = ModelWorker("smollm2-135m", smollm_path, max_context=256, metrics=ServerMetrics(process=False),
                    ledger=LedgerWriter(db), prices=PriceTable.builtin(), limiter=RateLimiter(db), warmup=False,
                    activation_bits=8)
    assert w._load().kernels_in_use().endswith(("vnni-int8", "avx2-int8"))


def test_worker_builds_its_engine_with_the_drafters(tmp_path, smollm_path):
    """`serve --draft-model M --drafters ... --self-spec-layers ...` reach the engine the worker loads: its
    ultrafast requests draft with those drafters."""
    db = Database(tmp_path / "s.db").init()
    w = ModelWorker("smollm2-135m", smollm_path, max_context=256, metrics=ServerMetrics(process=False),
                    ledger=LedgerWriter(db), prices=PriceTable.builtin(), limiter=RateLimiter(db), warmup=False,
                    drafters=["self_spec", "draft_model"], draft_model=smollm_path, self_spec_layers="0-3,25-29")
    engine = w._load()
    assert engine.default_drafters == ["self_spec", "draft_model"] and engine.draft_engine is not None
    assert engine.self_spec_layers == [0, 1, 2, 3, 25, 26, 27, 28, 29]
    stepper = engine.stepper("ultrafast")
    assert [d.name for d in stepper.drafters] == ["self_spec", "draft_model"]


def test_sqlite_ledger_is_created_owner_only(tmp_path):
    """The database holds spend and key hashes: created 0600 (it was 0644), and so are SQLite's -wal/-shm."""
    import os
    import stat

    from ultrafast.server.auth import KeyStore
    from ultrafast.server.db import Database

    path = tmp_path / "sub" / "ledger.db"
    KeyStore(Database(path)).create("someone", "standard")  # creates the file and writes to it
    for p in [path] + [path.with_name(path.name + s) for s in ("-wal", "-shm")]:
        if p.exists():
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    assert path.exists()


def test_batched_pass_shares_only_a_request_prompt_rows():
    """Candidates of one prompt of one request share its rows (but the last, which each computes); another
    request's candidate with the same prompt does not (its slot's rows are its own to change)."""
    from types import SimpleNamespace as NS
    r1, r2 = object(), object()
    p = list(range(20))
    cands = [NS(req=r1, group=0, prompt_ids=p), NS(req=r2, group=0, prompt_ids=p), NS(req=r1, group=0, prompt_ids=p),
             NS(req=r1, group=1, prompt_ids=p[:5]), NS(req=r1, group=1, prompt_ids=p[:5])]
    inputs = [([1], 25, None), ([1], 20, None), ([1], 31, None), ([1], 5, None), ([1], 9, None)]
    assert _shared_prompts(cands, inputs) == [None, None, (0, 19), None, (3, 4)]
    assert _shared_prompts(cands[:2], inputs[:2]) is None


def _best_of_n(path, engine, prompt, n: int, make_params, tier: str = "standard"):
    """One request for n candidates of `prompt`, through a worker of n slots over `engine` (its folder `path`):
    the request's messages and the worker, stopped."""
    msgs, done = [], threading.Event()
    req = GenRequest(model="fake", tier=tier, endpoint="completions", principal=LOCAL_USER, prompts=[prompt], n=n,
                     emit=lambda m: (msgs.append(m), m[0] == "done" and done.set()), make_params=make_params)
    path.mkdir()
    w, _ = _worker(path, engine, slots=n)
    w.submit(req)
    w.start()
    w.wait_ready(10)
    try:
        assert done.wait(60)
    finally:
        w.stop()
    return msgs, w


def test_best_of_n_passes_share_the_prompt_rows_and_keep_the_bits(tmp_path, smollm_path, monkeypatch):
    """n = 4 sampled candidates of one prompt: their batched passes are told of the shared prompt rows, the siblings
    start from the logits the first candidate computed for the prompt's last row (no forward of their own), and the
    candidates' tokens are those of the same request run with all three left out (each sibling computing that row,
    and every candidate its own row where another's tokens so far are the same)."""
    from ultrafast.server import scheduler
    from ultrafast.engine import Engine
    from ultrafast.generation import Generation

    engine = Engine.from_path(smollm_path, max_context=512)
    prompt = engine.chat_prompt([{"role": "user", "content": "Name a colour and say why you like it."}])
    forward_batch, forward, prefill = engine.forward_batch, engine.forward, Generation.prefill

    def run(keep_share: bool):
        shares, forwards = [], []

        def spy(seqs, hidden=False, share=None, all_logits=False):
            shares.append(share)
            return forward_batch(seqs, hidden=hidden, share=share if keep_share else None, all_logits=all_logits)

        def spy_forward(tokens, start_pos, **kw):
            forwards.append((len(tokens), start_pos))
            return forward(tokens, start_pos, **kw)

        def own_prefill(self, prompt_logits=None):
            return prefill(self)

        engine.forward_batch, engine.forward = spy, spy_forward
        engine.cache.tokens = []  # the worker's first slot is the engine's cache: no rows of the run before
        if not keep_share:
            Generation.prefill = own_prefill
            monkeypatch.setattr(scheduler, "_same_rows", lambda cands: [None] * len(cands))
        try:
            msgs, _ = _best_of_n(tmp_path / str(keep_share), engine, prompt, 4,
                                 lambda g, i: SamplingParams(max_tokens=16, temperature=1.0, seed=40 + i))
        finally:
            engine.forward_batch, engine.forward, Generation.prefill = forward_batch, forward, prefill
        return {m[1]: m[3].token_ids for m in msgs if m[0] == "choice_done"}, shares, forwards

    shared, shares, forwards = run(True)
    alone, _, own = run(False)
    assert len(shared) == 4 and shared == alone
    m = len(prompt) - 1
    assert any(s is not None and sum(x is not None and x[1] == m for x in s) == 3 for s in shares)
    # the first candidate's prefill; the siblings ran none and joined its first step, batched
    assert forwards == [(len(prompt), 0)]
    # with the logits dropped, each sibling's own forward of the prompt's last token
    assert own == [(len(prompt), 0)] + [(1, m)] * 3


def test_candidates_with_the_same_tokens_share_their_rows(tmp_path, smollm_path, monkeypatch):
    """Best-of-n candidates whose tokens so far are the same take one row of a batched pass between them: n = 3
    greedy candidates (the same tokens throughout) run every batched pass as one row, the others' caches get its keys
    and values, and the text is that of the request with the sharing left out (three rows a pass); then sampled
    candidates of which some agree: the same tokens with and without the sharing."""
    from ultrafast.engine import Engine
    from ultrafast.server import scheduler

    engine = Engine.from_path(smollm_path, max_context=512)
    prompt = engine.chat_prompt([{"role": "user", "content": "What is the capital of France? One word."}])
    forward_batch = engine.forward_batch

    def run(tag: str, share: bool, temperature: float, n: int = 3, tokens: int = 12, tier: str = "standard"):
        rows = []

        def spy(seqs, **kw):
            rows.append(len(seqs))
            return forward_batch(seqs, **kw)

        engine.forward_batch = spy
        engine.cache.tokens = []
        with monkeypatch.context() as m:
            if not share:
                m.setattr(scheduler, "_same_rows", lambda cands: [None] * len(cands))
            try:
                msgs, w = _best_of_n(tmp_path / tag, engine, prompt, n, lambda g, i: SamplingParams(
                    max_tokens=tokens, temperature=temperature, seed=7 + i, ignore_eos=True), tier)
            finally:
                engine.forward_batch = forward_batch
        same = w.metrics.same_rows.labels("fake")._value.get()
        return {x[1]: x[3].token_ids for x in msgs if x[0] == "choice_done"}, rows, same, w.slots

    twins, rows, same, slots = run("greedy", True, 0.0)
    apart, rows_apart, same_apart, _ = run("greedy-apart", False, 0.0)
    assert len(twins) == 3 and twins == apart and len({tuple(t) for t in twins.values()}) == 1
    assert rows and set(rows) == {1} and same == 2 * len(rows)  # every pass one row for the three
    # every slot holds the rows of prompt and output (the others' copied from the one that computed them)
    held = {len(s.cache.tokens) for s in slots}
    assert held == {len(prompt) + 11}
    n = held.pop()
    for s in slots[1:]:
        assert torch.equal(s.cache.k[:, :, :n], slots[0].cache.k[:, :, :n])
        assert torch.equal(s.cache.v[:, :, :n], slots[0].cache.v[:, :, :n])
    assert set(rows_apart) == {3} and same_apart == 0
    # sampled: candidates agree on some first tokens, then part; the sharing never changes a token
    got, _, same, _ = run("sampled", True, 0.7, n=4, tokens=16)
    want, _, _, _ = run("sampled-apart", False, 0.7, n=4, tokens=16)
    assert got == want and len(got) == 4 and same > 0  # (two of these four agree throughout)
    # the ultrafast tier (r(k) fixed, flat: drafts pay in shared passes): twins verify the first one's drafts too
    engine.r_table = [0.0, 1.0] + [1.0 + 0.03 * (k - 1) for k in range(2, 18)]
    fast, rows, same, slots = run("ultrafast-greedy", True, 0.0, tier="ultrafast", tokens=24)
    assert fast == run("ultrafast-greedy-apart", False, 0.0, tier="ultrafast", tokens=24)[0]
    assert len(fast) == 3 and len({tuple(t) for t in fast.values()}) == 1 and same > 0
    got, _, same, _ = run("ultrafast-sampled", True, 0.7, n=4, tokens=24, tier="ultrafast")
    assert got == run("ultrafast-sampled-apart", False, 0.7, n=4, tokens=24, tier="ultrafast")[0] and same > 0
    # the suffix drafter kept their text in the requests' tenant's history, not the process's
    assert engine.suffix_cache((LOCAL_USER.key_id, None)).index.tokens and not engine.suffix_cache(None).index.tokens
