"""Stored responses of the Responses API, in the service's database: what `previous_response_id` continues.

A stored row holds the response object and its context: the conversation's input items up to it (the earlier
responses' inputs and outputs, then this request's input; instructions are not carried over, as OpenAI's are
not). A continuation reads one row: its context followed by its output. Rows belong to the key that made them:
another key (or the local user, for a key's row) does not see them.
"""

from __future__ import annotations

import json

from .db import Database


def save(db: Database, response: dict, context: list[dict], key_id: str | None) -> None:
    db.execute("INSERT INTO responses (response_id, key_id, model, created_at, context, response) "
               "VALUES (?, ?, ?, ?, ?, ?)",
               (response["id"], key_id, response["model"], response["created_at"],
                json.dumps(context, ensure_ascii=False), json.dumps(response, ensure_ascii=False)))


def _row(db: Database, response_id: str, key_id: str | None) -> dict | None:
    if key_id is None:
        rows = db.query("SELECT context, response FROM responses WHERE response_id = ? AND key_id IS NULL",
                        (response_id,))
    else:
        rows = db.query("SELECT context, response FROM responses WHERE response_id = ? AND key_id = ?",
                        (response_id, key_id))
    return rows[0] if rows else None


def load(db: Database, response_id: str, key_id: str | None) -> dict | None:
    """The stored response object, or None (unknown, or another key's)."""
    row = _row(db, response_id, key_id)
    return json.loads(row["response"]) if row else None


def conversation(db: Database, response_id: str, key_id: str | None) -> list[dict] | None:
    """The items a continuation of `response_id` starts from (its context, then its output), or None."""
    row = _row(db, response_id, key_id)
    if row is None:
        return None
    return json.loads(row["context"]) + json.loads(row["response"])["output"]


def delete(db: Database, response_id: str, key_id: str | None) -> bool:
    if key_id is None:
        rows = db.execute("DELETE FROM responses WHERE response_id = ? AND key_id IS NULL RETURNING response_id",
                          (response_id,))
    else:
        rows = db.execute("DELETE FROM responses WHERE response_id = ? AND key_id = ? RETURNING response_id",
                          (response_id, key_id))
    return bool(rows)
