"""The ledger: exactly one row per finished or cancelled request, and the usage reports made from it.

Rows are written by one thread (`LedgerWriter`), each in its own transaction, so a row is either
committed whole or absent: a server killed mid-request leaves the rows of the requests that had
finished and nothing of the others. A request's response is only completed after its row is
committed (the server waits on the future `submit` returns), so a client that saw a finished response
can count on its row.

`status`: `finished` (the model stopped or reached max_tokens), `cancelled` (the client went away; the
tokens generated until then are billed), `failed` (an internal error mid-generation).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from .db import Database

STATUSES = ("finished", "cancelled", "failed")


@dataclass
class LedgerRow:
    request_id: str
    key_id: str | None
    model: str
    tier: str
    endpoint: str  # chat.completions / completions
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
    ts: float = field(default_factory=time.time)

    @property
    def day(self) -> str:
        return datetime.fromtimestamp(self.ts, timezone.utc).strftime("%Y-%m-%d")

    def to_json(self) -> dict:
        return {**asdict(self), "day": self.day}


_COLUMNS = ("request_id", "key_id", "model", "tier", "endpoint", "n", "prompt_tokens", "cached_tokens",
            "completion_tokens", "cost_usd", "queue_s", "ttft_s", "total_s", "decode_tokens_per_s", "tau",
            "status", "ts", "day")


def insert_row(db: Database, row: LedgerRow) -> None:
    if row.status not in STATUSES:
        raise ValueError(f"ledger status must be one of {STATUSES}, got {row.status!r}")
    values = row.to_json()
    with db.transaction() as cur:
        cur.execute(f"INSERT INTO ledger ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                    tuple(values[c] for c in _COLUMNS))


class LedgerWriter:
    """One thread that owns the writes: `submit(row)` returns a Future done once the row is committed."""

    def __init__(self, db: Database):
        self.db = db.init()
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ultrafast-ledger", daemon=True)
        self._thread.start()
        self.written = 0
        self.failed = 0

    def submit(self, row: LedgerRow) -> Future:
        fut: Future = Future()
        self._q.put((row, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                break
            row, fut = item
            for attempt in range(3):
                try:
                    insert_row(self.db, row)
                    self.written += 1
                    fut.set_result(True)
                    break
                except Exception as e:  # a locked/busy database: retry a little, then report
                    if attempt == 2:
                        self.failed += 1
                        fut.set_exception(e)
                    else:
                        time.sleep(0.05 * (attempt + 1))

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
                    "cancelled": int(r["cancelled"] or 0), "prompt_tokens": int(r["prompt_tokens"] or 0),
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
