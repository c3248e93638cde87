"""The ledger: one row per request that reached generation, opened when it starts and settled as it goes,
and the usage reports made from it.

A request's row is written when its generation starts (`running`, billing its prompt), rewritten as tokens
are generated (at least every `SETTLE_TOKENS` completion tokens or `SETTLE_S` seconds, whichever comes
first) and closed when it ends: `finished` (the model stopped or reached max_tokens), `cancelled` (the client
went away; the tokens generated until then are billed) or `failed` (an internal error mid-generation). Each
write is its own transaction, so a row is either committed whole or absent. A server killed mid-request
leaves its rows `running` with what was settled; the next server on the database (or this one's periodic
sweep) marks them `interrupted` (`interrupt_abandoned`): a crash loses the billing of at most
SETTLE_TOKENS - 1 tokens (or SETTLE_S seconds of generation) per request, plus writes still queued for the
ledger thread. A request's response is only completed after its final row is committed (the server waits on
the future `submit` returns), so a client that saw a finished response can count on its row.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from .db import Database

log = logging.getLogger("ultrafast.server")

STATUSES = ("running", "finished", "cancelled", "failed", "interrupted")
SETTLE_TOKENS = 16  # a running row is rewritten at least this often, in completion tokens ...
SETTLE_S = 2.0  # ... or seconds (while tokens come)
STALE_S = 600.0  # a running row of another host's server not rewritten for this long is abandoned
SWEEP_S = 60.0  # how often a writer looks for abandoned rows


@dataclass
class LedgerRow:
    request_id: str
    key_id: str | None
    model: str
    tier: str
    endpoint: str  # chat.completions / completions / responses
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    queue_s: float
    total_s: float
    status: str
    n: int = 1
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    tau: float | None = None
    ts: float = field(default_factory=time.time)  # when the row was opened
    updated_ts: float | None = None  # when it was last written (the writer sets it)
    instance: str | None = None  # the server process that writes it, host/pid/id (the writer sets it)

    @property
    def day(self) -> str:
        return datetime.fromtimestamp(self.ts, timezone.utc).strftime("%Y-%m-%d")

    def to_json(self) -> dict:
        return {**asdict(self), "day": self.day}


_COLUMNS = ("request_id", "key_id", "model", "tier", "endpoint", "n", "prompt_tokens", "cached_tokens",
            "completion_tokens", "cost_usd", "queue_s", "ttft_s", "total_s", "decode_tokens_per_s", "tau",
            "status", "ts", "day", "updated_ts", "instance")
_UPSERT = (f"INSERT INTO ledger ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
           f"ON CONFLICT (request_id) DO UPDATE SET "
           + ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS if c not in ("request_id", "ts", "day"))
           + " WHERE ledger.status = 'running' RETURNING id")


def write_row(db: Database, row: LedgerRow) -> None:
    """Open or rewrite a request's row. A row already closed (any status but `running`) is never rewritten:
    ValueError."""
    if row.status not in STATUSES:
        raise ValueError(f"ledger status must be one of {STATUSES}, got {row.status!r}")
    if row.updated_ts is None:
        row.updated_ts = time.time()
    values = row.to_json()
    with db.transaction() as cur:
        if not cur.execute(_UPSERT, tuple(values[c] for c in _COLUMNS)):
            raise ValueError(f"the ledger row of request {row.request_id} is already closed")


def instance_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def interrupt_abandoned(db: Database, instance: str, now: float | None = None) -> int:
    """Mark `interrupted` the running rows no live server will settle: those of a process on this host that
    is gone, and those of any other server not rewritten for STALE_S seconds. Returns how many."""
    now = time.time() if now is None else now
    host = instance.split("/")[0]
    n = 0
    for r in db.query("SELECT request_id, instance, updated_ts FROM ledger WHERE status = 'running'"):
        owner = r["instance"] or ""
        if owner == instance:
            continue
        o_host, _, rest = owner.partition("/")
        pid = rest.partition("/")[0]
        gone = o_host == host and pid.isdigit() and not _alive(int(pid))
        stale = (r["updated_ts"] or 0.0) < now - STALE_S
        if gone or stale or not owner:
            with db.transaction() as cur:
                n += len(cur.execute("UPDATE ledger SET status = 'interrupted', updated_ts = ? "
                                     "WHERE request_id = ? AND status = 'running' RETURNING id",
                                     (now, r["request_id"])))
    return n


def _resolve(futs: list[Future], error: BaseException | None) -> None:
    """Settle the waiters' futures. One its waiter cancelled (a handler whose client went away: asyncio's
    wrap_future passes the cancel on) is left as it is; the row was written all the same."""
    for f in futs:
        try:
            if error is None:
                f.set_result(True)
            else:
                f.set_exception(error)
        except InvalidStateError:  # cancelled (or already settled): nobody waits on it
            pass


class LedgerWriter:
    """One thread that owns the writes: `submit(row)` returns a Future done once the row is committed.
    Rewrites of one request queued behind each other are coalesced (the latest wins). `submit(row, then=f)` also
    runs f on this thread once the row's write was tried and before its Future is settled (other bookkeeping a
    request's end needs, kept off the thread that decodes, and done by the time the client is answered). It
    marks abandoned rows `interrupted` when it starts and every SWEEP_S seconds."""

    def __init__(self, db: Database, sweep_s: float = SWEEP_S):
        self.db = db.init()
        self.instance = instance_id()
        self.sweep_s = sweep_s
        self._q: queue.Queue = queue.Queue()
        self.written = 0
        self.failed = 0
        self.interrupted = 0  # abandoned rows this writer marked
        self._thread = threading.Thread(target=self._run, name="ultrafast-ledger", daemon=True)
        self._thread.start()

    def submit(self, row: LedgerRow, then: Callable[[], None] | None = None) -> Future:
        row.instance = self.instance
        fut: Future = Future()
        self._q.put((row, fut, then))
        return fut

    def _sweep(self) -> None:
        try:
            self.interrupted += interrupt_abandoned(self.db, self.instance)
        except Exception:  # a busy database: the next sweep tries again
            pass

    def _run(self) -> None:
        self._sweep()
        next_sweep = time.monotonic() + self.sweep_s
        while True:
            try:
                item = self._q.get(timeout=max(0.0, next_sweep - time.monotonic()))
            except queue.Empty:
                self._sweep()
                next_sweep = time.monotonic() + self.sweep_s
                continue
            batch, stop = [item], item is None
            while not stop:  # take what else is queued; a request's later rows replace its earlier ones
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                stop = nxt is None
                if not stop:
                    batch.append(nxt)
            latest: dict[str, LedgerRow] = {}
            futs: dict[str, list] = {}
            thens: dict[str, list] = {}
            for it in batch:
                if it is None:
                    continue
                row, fut, then = it
                if row.request_id in latest and latest[row.request_id].status != "running":
                    self._write(row, [fut], [then])  # after a closing row: written (and refused) on its own
                    continue
                latest[row.request_id] = row
                futs.setdefault(row.request_id, []).append(fut)
                thens.setdefault(row.request_id, []).append(then)
            for rid, row in latest.items():
                self._write(row, futs[rid], thens[rid])
            if stop:
                break

    def _write(self, row: LedgerRow, futs: list, thens: list) -> None:
        try:
            error = self._write_row(row)
        except Exception as e:  # a bug: its waiters hear of it, and the writer goes on with the next rows
            log.exception("the ledger writer failed on request %s", row.request_id)
            error = e
        for then in thens:  # before the waiters hear: a client answered has had its request's bookkeeping done
            if then is None:
                continue
            try:
                then()
            except Exception:  # the row's own outcome stands; the writer goes on
                log.exception("the ledger writer: bookkeeping after request %s failed", row.request_id)
        _resolve(futs, error)

    def _write_row(self, row: LedgerRow) -> BaseException | None:
        """Write (or rewrite) the row; returns what stopped it, None once committed."""
        for attempt in range(3):
            try:
                row.updated_ts = None
                write_row(self.db, row)
            except ValueError as e:  # refused (a closed row): no retry
                self.failed += 1
                return e
            except Exception as e:  # a locked/busy database: retry a little, then report
                if attempt == 2:
                    self.failed += 1
                    return e
                time.sleep(0.05 * (attempt + 1))
            else:
                self.written += 1
                return None
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop."""
        self._q.put(None)
        self._thread.join(timeout)


# ------------------------------------------------------------------------------------ reports


def usage(db: Database, *, key_id: str | None = None, all_keys: bool = True, since_day: str | None = None) -> list[dict]:
    """Spend per key, model, tier and day (newest day first). `all_keys=False` restricts to `key_id`
    (None meaning the local user's requests)."""
    where, params = [], []
    if not all_keys:
        if key_id is None:
            where.append("l.key_id IS NULL")
        else:
            where.append("l.key_id = ?")
            params.append(key_id)
    if since_day:
        where.append("l.day >= ?")
        params.append(since_day)
    sql = ("SELECT l.key_id AS key_id, k.name AS key_name, l.model AS model, l.tier AS tier, l.day AS day, "
           "COUNT(*) AS requests, "
           "SUM(CASE WHEN l.status = 'cancelled' THEN 1 ELSE 0 END) AS cancelled, "
           "SUM(CASE WHEN l.status = 'interrupted' THEN 1 ELSE 0 END) AS interrupted, "
           "SUM(l.prompt_tokens) AS prompt_tokens, SUM(l.cached_tokens) AS cached_tokens, "
           "SUM(l.completion_tokens) AS completion_tokens, SUM(l.cost_usd) AS cost_usd "
           "FROM ledger l LEFT JOIN api_keys k ON k.key_id = l.key_id "
           + (f"WHERE {' AND '.join(where)} " if where else "")
           + "GROUP BY l.key_id, k.name, l.model, l.tier, l.day ORDER BY l.day DESC, l.key_id, l.model, l.tier")
    rows = db.query(sql, tuple(params))
    out = []
    for r in rows:
        out.append({"key_id": r["key_id"], "key_name": r["key_name"] or ("local" if r["key_id"] is None else None),
                    "model": r["model"], "tier": r["tier"], "day": r["day"], "requests": int(r["requests"]),
                    "cancelled": int(r["cancelled"] or 0), "interrupted": int(r["interrupted"] or 0),
                    "prompt_tokens": int(r["prompt_tokens"] or 0),
                    "cached_tokens": int(r["cached_tokens"] or 0),
                    "completion_tokens": int(r["completion_tokens"] or 0),
                    "cost_usd": round(float(r["cost_usd"] or 0.0), 8)})
    return out


def rows(db: Database, limit: int | None = None) -> list[dict]:
    sql = f"SELECT {', '.join(_COLUMNS)} FROM ledger ORDER BY id"
    if limit:
        sql += f" LIMIT {int(limit)}"
    return db.query(sql)


def format_usage(records: list[dict]) -> str:
    if not records:
        return "no usage recorded"
    head = ["day", "key", "model", "tier", "requests", "prompt", "cached", "completion", "cost $"]
    lines = [head]
    for r in records:
        key = f"{r['key_name']} ({r['key_id']})" if r["key_id"] else "local (no key)"
        lines.append([r["day"], key, r["model"], r["tier"], str(r["requests"]), str(r["prompt_tokens"]),
                      str(r["cached_tokens"]), str(r["completion_tokens"]), f"{r['cost_usd']:.6f}"])
    total = sum(r["cost_usd"] for r in records)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in lines)
    return text + f"\ntotal: ${total:.6f}"
