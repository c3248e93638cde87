"""Tokens per minute per key, over a sliding 60 s window, kept in the service database so that the limit holds
across every replica that shares it (PostgreSQL), not once per process.

A request is admitted while the key's tokens in the last minute plus its prompt fit the limit; its completion
tokens are added when it ends. So a key can overshoot by one request's completion, never more, and a request is
never refused for a completion it might not produce.

Each admission is one transaction: the key's expired events are deleted, its window summed, and the prompt's
event inserted, under a lock on the key (PostgreSQL: a transaction-scoped advisory lock on the key's hash, so two
replicas admitting for one key take turns; SQLite: the database's write lock). Keys without a limit, and the
local user, never touch the database. Times are the replicas' wall clocks (keep them synchronised, e.g. NTP).
"""

from __future__ import annotations

import logging
import time

from .db import Database
from .errors import RateLimited

WINDOW = 60.0
log = logging.getLogger("ultrafast.server")


class RateLimiter:
    def __init__(self, db: Database, clock=time.time):
        self.db = db.init()
        self._clock = clock

    def _lock_key(self, cur, key_id: str) -> None:
        if self.db.kind == "postgres":
            cur.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (key_id,))

    def admit(self, principal, prompt_tokens: int):
        """Admit a request's prompt against the key's limit (RateLimited if it does not fit); the returned
        reservation can be refunded if the request is then refused for another reason."""
        if principal.tpm is None or principal.key_id is None:
            return None
        tpm, key = principal.tpm, principal.key_id
        if prompt_tokens > tpm:
            raise RateLimited(f"Request too large: {prompt_tokens} prompt tokens exceed this key's limit of "
                              f"{tpm} tokens per minute.", retry_after=WINDOW, code="request_too_large")
        with self.db.transaction() as cur:
            self._lock_key(cur, key)
            now = self._clock()
            cur.execute("DELETE FROM rate_events WHERE key_id = ? AND ts <= ?", (key, now - WINDOW))
            events = cur.execute("SELECT ts, tokens FROM rate_events WHERE key_id = ? ORDER BY ts, id", (key,))
            used = sum(e["tokens"] for e in events)
            if used + prompt_tokens > tpm:
                # wait until enough of the window has expired
                need, freed, retry = used + prompt_tokens - tpm, 0, WINDOW
                for e in events:
                    freed += e["tokens"]
                    if freed >= need:
                        retry = e["ts"] + WINDOW - now
                        break
                raise RateLimited(f"Rate limit reached: {used} of {tpm} tokens per minute used in the last minute; "
                                  f"this request needs {prompt_tokens} more. Retry after {max(1, round(retry))} s.",
                                  retry_after=retry)
            row = cur.execute("INSERT INTO rate_events (key_id, ts, tokens) VALUES (?, ?, ?) RETURNING id",
                              (key, now, prompt_tokens))
            return row[0]["id"]

    def refund(self, principal, reservation) -> None:
        if reservation is None or principal.key_id is None:
            return
        self.db.execute("DELETE FROM rate_events WHERE id = ?", (reservation,))

    def record(self, principal, tokens: int) -> None:
        """Tokens a request used past its prompt (its completion), counted when it ends."""
        if principal.tpm is None or principal.key_id is None or tokens <= 0:
            return
        try:
            self.db.execute("INSERT INTO rate_events (key_id, ts, tokens) VALUES (?, ?, ?)",
                            (principal.key_id, self._clock(), tokens))
        except Exception:  # the request is done either way: a lost count is logged, never raised into the worker
            log.exception("rate limit: %d completion tokens of key %s not recorded", tokens, principal.key_id)
