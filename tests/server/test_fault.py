"""Faults: SIGKILL in the middle of streaming requests leaves a ledger with the finished requests' rows and
the running ones' rows settled to within SETTLE_TOKENS of what was streamed, nothing half-written; a restart
on the same database marks those `interrupted`, serves and appends. SIGTERM (graceful) records the requests
it cuts short as cancelled."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx
import openai

from ultrafast.server.ledger import SETTLE_TOKENS

MODEL = "smollm2-135m"


def _rows(db_path: str) -> list[tuple]:
    with sqlite3.connect(db_path) as db:
        return db.execute("SELECT request_id, status, prompt_tokens, completion_tokens, cost_usd FROM ledger "
                          "ORDER BY id").fetchall()


def _integrity(db_path: str) -> str:
    with sqlite3.connect(db_path) as db:
        return db.execute("PRAGMA integrity_check").fetchone()[0]


def _stream_until_killed(url: str, seen: threading.Event, out: list, ids: dict):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about the sea."}],
            "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = 0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if chunks == 1:
                        ids[json.loads(line[6:])["id"]] = 0
                    ids[next(reversed(ids))] = chunks - 1  # content chunks after the role's
                    if chunks == 40:
                        seen.set()
                    if line == "data: [DONE]":
                        out.append(("done", chunks))
                        return
        out.append(("closed", chunks))
    except httpx.HTTPError as e:
        out.append((type(e).__name__, chunks))
    finally:
        seen.set()


def test_sigkill_mid_stream_then_restart(server_factory):
    db = str(server_factory.tmp / "fault.db")
    srv = server_factory(db, "--max-context", "1024", "--slots", "4", "--no-warmup")
    c = openai.OpenAI(base_url=srv.base_url, api_key="local", max_retries=0, timeout=120)
    finished = []
    for i in range(3):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say the number {i}."}],
                                      max_tokens=8, temperature=0)
        finished.append(r.id)
    # three long streams in flight, then SIGKILL
    seen = [threading.Event() for _ in range(3)]
    outcomes: list = []
    streamed = [{} for _ in seen]  # request id -> content chunks received
    threads = [threading.Thread(target=_stream_until_killed, args=(srv.url, ev, outcomes, ids))
               for ev, ids in zip(seen, streamed)]
    for t in threads:
        t.start()
    for ev in seen:
        assert ev.wait(120)
    srv.kill()
    for t in threads:
        t.join(30)
    assert len(outcomes) == 3 and all(o[0] != "done" for o in outcomes), outcomes
    assert _integrity(db) == "ok"
    rows = _rows(db)
    assert [r[0] for r in rows[:3]] == finished and all(r[1] == "finished" for r in rows[:3])
    assert all(r[3] >= 1 and r[4] > 0 for r in rows)
    # the streams' rows were opened as they started and settled as they went: each bills what its client
    # received, less at most SETTLE_TOKENS tokens generated since the last write
    running = {r[0]: r for r in rows[3:]}
    received = {rid: n for ids in streamed for rid, n in ids.items()}
    assert set(running) == set(received) and all(r[1] == "running" for r in running.values())
    for rid, n in received.items():
        assert n - SETTLE_TOKENS <= running[rid][3] and 16 <= running[rid][3], (n, running[rid])

    # restart on the same database, with a second model this time (a copy under another name): it serves
    # both by name, and appends
    second = server_factory.tmp / "second-model.gguf"
    second.symlink_to(srv.model)
    srv2 = server_factory(db, "--max-context", "1024", "--no-warmup", "--model", str(second))
    c2 = openai.OpenAI(base_url=srv2.base_url, api_key="local", max_retries=0, timeout=120)
    assert [m.id for m in c2.models.list().data] == [MODEL, "second-model"]
    r = c2.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                   temperature=0)
    r2 = c2.chat.completions.create(model="second-model", messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=4, temperature=0)
    assert r2.model == "second-model" and r2.choices[0].message.content == r.choices[0].message.content
    rows2 = _rows(db)
    assert [x[0] for x in rows2] == [x[0] for x in rows] + [r.id, r2.id]
    # the new server found the killed one's running rows abandoned: interrupted, billed as settled
    assert [(x[1], x[3]) for x in rows2[3:6]] == [("interrupted", x[3]) for x in rows[3:6]]
    usage = httpx.get(srv2.base_url + "/usage").json()  # local mode: the local user's usage
    assert usage["total_requests"] == 8 and {u["model"] for u in usage["data"]} == {MODEL, "second-model"}
    assert sum(u["interrupted"] for u in usage["data"]) == 3

    # SIGTERM with a stream in flight: a graceful stop bills it as cancelled, exactly once
    seen2, outcomes2 = threading.Event(), []
    t = threading.Thread(target=_stream_until_killed, args=(srv2.url, seen2, outcomes2, {}))
    t.start()
    assert seen2.wait(120)
    t0 = time.monotonic()
    assert srv2.stop(timeout=30) is not None
    t.join(30)
    assert time.monotonic() - t0 < 30
    rows = _rows(db)
    assert len(rows) == 9 and rows[-1][1] == "cancelled" and 0 < rows[-1][3] < 900
    assert _integrity(db) == "ok"
