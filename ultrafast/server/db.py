"""The service's database: API keys, the ledger, rate-limit events and stored responses.

SQLite by default (a file path; WAL journal, so readers never block the writer and a killed process
leaves every committed row intact and no half-written one), PostgreSQL when the target is a
`postgresql://` (or `postgres://`) URL, through psycopg 3. SQL is written once with `?` placeholders and
translated for psycopg.

Connections are per thread (sqlite3 and psycopg connections are not shared across threads); each
statement group runs in its own transaction.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def default_db_path() -> Path:
    from ..pull import home_dir

    return home_dir() / "ultrafast.db"


def is_postgres_url(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


_SQLITE_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        key_hash TEXT NOT NULL,
        tiers TEXT NOT NULL,
        tpm INTEGER,
        created_at REAL NOT NULL,
        revoked_at REAL
    )""",
    """CREATE TABLE IF NOT EXISTS ledger (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        request_id TEXT NOT NULL UNIQUE,
        key_id TEXT,
        model TEXT NOT NULL,
        tier TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        n INTEGER NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        cost_usd REAL NOT NULL,
        queue_s REAL NOT NULL,
        ttft_s REAL,
        total_s REAL NOT NULL,
        decode_tokens_per_s REAL,
        tau REAL,
        status TEXT NOT NULL,
        ts REAL NOT NULL,
        day TEXT NOT NULL,
        updated_ts REAL,
        instance TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS ledger_key_day ON ledger (key_id, day)",
    # tokens per minute per key (rate_limit.py): the last minute's events, shared by every replica
    """CREATE TABLE IF NOT EXISTS rate_events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        key_id TEXT NOT NULL,
        ts REAL NOT NULL,
        tokens INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS rate_events_key_ts ON rate_events (key_id, ts)",
    # stored Responses API responses (responses.py): the conversation before the output, for previous_response_id
    """CREATE TABLE IF NOT EXISTS responses (
        response_id TEXT PRIMARY KEY,
        key_id TEXT,
        model TEXT NOT NULL,
        created_at REAL NOT NULL,
        context TEXT NOT NULL,
        response TEXT NOT NULL
    )""",
]

# columns added since the first schema: added to an older database by `init`
_ADDED_COLUMNS = [("ledger", "updated_ts", "REAL"), ("ledger", "instance", "TEXT")]

_PG_SCHEMA = [
    s.replace("id INTEGER PRIMARY KEY AUTOINCREMENT", "id BIGSERIAL PRIMARY KEY")
    .replace(" REAL", " DOUBLE PRECISION").replace(" INTEGER", " BIGINT")
    for s in _SQLITE_SCHEMA
]


class Database:
    """A database target (SQLite path or PostgreSQL URL) with per-thread connections."""

    def __init__(self, target: str | os.PathLike | None = None):
        target = str(target) if target is not None else str(default_db_path())
        self.target = target
        self.kind = "postgres" if is_postgres_url(target) else "sqlite"
        if self.kind == "sqlite" and target != ":memory:":
            path = Path(target).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self.target = str(path)
            # created owner-only: it holds spend and key hashes (SQLite gives its -wal and -shm files the
            # database file's permissions). Only here, before this object opens any connection: closing a
            # descriptor of the file drops every POSIX lock the process holds on it, SQLite's included
            # (doing this per connection gave "disk I/O error" under concurrent requests).
            try:
                os.close(os.open(self.target, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            except FileExistsError:
                pass
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._initialised = False

    def __repr__(self) -> str:
        return f"Database({self.describe()})"

    def describe(self) -> str:
        if self.kind == "postgres":  # never print a password
            from urllib.parse import urlsplit

            u = urlsplit(self.target)
            host = u.hostname or "localhost"
            return f"postgresql://{host}{':' + str(u.port) if u.port else ''}{u.path}"
        return self.target

    # ---------------------------------------------------------------- connections

    def _connect(self):
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.target, timeout=30, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL with WAL: a commit survives a killed process (only a power cut can lose the last ones)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.row_factory = sqlite3.Row
            return conn
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise RuntimeError("a postgresql:// database needs psycopg: pip install 'ultrafast[postgres]'") from e
        return psycopg.connect(self.target, autocommit=True, row_factory=dict_row)

    def conn(self):
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._connect()
            self._local.conn = c
            with self._lock:
                self._all.append(c)
        return c

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            try:
                c.close()
            except Exception:
                pass
        self._local = threading.local()

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.kind == "postgres" else sql

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor inside one transaction: committed on success, rolled back on an exception."""
        c = self.conn()
        if self.kind == "sqlite":
            c.execute("BEGIN IMMEDIATE")
            try:
                yield _Cursor(self, c)
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")
        else:
            with c.transaction():
                yield _Cursor(self, c)

    def execute(self, sql: str, params: tuple = ()) -> list[dict]:
        """One statement in its own transaction; the rows it returns as dicts."""
        with self.transaction() as cur:
            return cur.execute(sql, params)

    def query(self, sql: str, params: tuple = ()) -> list[dict]:
        c = self.conn()
        if self.kind == "sqlite":
            return [dict(r) for r in c.execute(sql, params).fetchall()]
        with c.cursor() as cur:
            cur.execute(self._sql(sql), params)
            return list(cur.fetchall()) if cur.description else []

    def init(self) -> "Database":
        if self._initialised:
            return self
        schema = _SQLITE_SCHEMA if self.kind == "sqlite" else _PG_SCHEMA
        with self.transaction() as cur:
            for stmt in schema:
                cur.execute(stmt)
            for table, column, kind in _ADDED_COLUMNS:
                if self.kind == "postgres":
                    kind = kind.replace("REAL", "DOUBLE PRECISION")
                    cur.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind}")
                elif column not in {r["name"] for r in cur.execute(f"PRAGMA table_info({table})")}:
                    cur.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._initialised = True
        return self


class _Cursor:
    def __init__(self, db: Database, conn):
        self.db, self.conn = db, conn

    def execute(self, sql: str, params: tuple = ()) -> list[dict]:
        if self.db.kind == "sqlite":
            cur = self.conn.execute(sql, params)
            return [dict(r) for r in cur.fetchall()] if cur.description else []
        with self.conn.cursor() as cur:
            cur.execute(self.db._sql(sql), params)
            return list(cur.fetchall()) if cur.description else []
