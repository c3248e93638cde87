"""API keys, the tiers they may use, and their tokens-per-minute limits (enforced by rate_limit.py).

A key reads `uf-<key_id>-<secret>`. The database keeps `key_id` (the primary key, so a lookup is one
index probe) and the sha256 of the whole key, never the key itself; it is printed once, at creation.
Comparison is constant-time. Revoked keys stay in the table (the ledger refers to them) with `revoked_at`.

Tiers: `standard`, `ultrafast` (sold separately). A request's `service_tier` may be either, or `auto`: the
best tier the key may use. A request with no `service_tier` gets `standard`, so nobody pays the
ultrafast price without asking for it.

Local mode: with no `--require-keys` on a loopback host, requests need no key and may use every tier
(they are recorded under no key); a valid key, if sent, is still used. On any other host keys are
always required.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass

from .db import Database
from .errors import AuthError, InvalidRequest, TierNotEntitled
from .pricing import TIERS

KEY_PREFIX = "uf"
TIER_CHOICES = ("standard", "ultrafast", "auto")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key, or the local user (key_id None)."""

    key_id: str | None
    name: str
    tiers: frozenset[str]
    tpm: int | None = None

    @property
    def local(self) -> bool:
        return self.key_id is None


LOCAL_USER = Principal(key_id=None, name="local", tiers=frozenset(TIERS), tpm=None)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_tiers(text: str) -> list[str]:
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    if not tiers:
        raise ValueError("--tiers needs at least one of: standard, ultrafast")
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise ValueError(f"unknown tier(s) {bad}: choose from standard, ultrafast")
    return sorted(set(tiers), key=TIERS.index)


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KeyStore:
    def __init__(self, db: Database):
        self.db = db.init()

    def create(self, name: str, tiers: list[str] | str = ("standard",), tpm: int | None = None) -> tuple[str, dict]:
        """A new key: (the secret, shown once; its record)."""
        if not name or not name.strip():
            raise ValueError("a key needs a --name")
        tiers = parse_tiers(tiers) if isinstance(tiers, str) else parse_tiers(",".join(tiers))
        if tpm is not None and tpm <= 0:
            raise ValueError("--tpm must be a positive number of tokens per minute")
        key_id = secrets.token_hex(6)
        secret = f"{KEY_PREFIX}-{key_id}-{secrets.token_urlsafe(30)}"
        now = time.time()
        self.db.execute("INSERT INTO api_keys (key_id, name, key_hash, tiers, tpm, created_at, revoked_at) "
                        "VALUES (?, ?, ?, ?, ?, ?, NULL)", (key_id, name.strip(), hash_key(secret), ",".join(tiers),
                                                            tpm, now))
        return secret, self.get(key_id)

    def get(self, key_id: str) -> dict | None:
        rows = self.db.query("SELECT key_id, name, tiers, tpm, created_at, revoked_at FROM api_keys WHERE key_id = ?",
                             (key_id,))
        return _record(rows[0]) if rows else None

    def list(self) -> list[dict]:
        rows = self.db.query("SELECT key_id, name, tiers, tpm, created_at, revoked_at FROM api_keys "
                             "ORDER BY created_at")
        return [_record(r) for r in rows]

    def revoke(self, key_id: str) -> dict:
        if key_id.startswith(f"{KEY_PREFIX}-"):  # accept the whole key too
            key_id = key_id.split("-", 2)[1]
        rec = self.get(key_id)
        if rec is None:
            raise ValueError(f"no key with id {key_id!r}")
        if rec["revoked_at"] is None:
            self.db.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                            (time.time(), key_id))
        return self.get(key_id)

    def verify(self, key: str) -> Principal:
        """The key's principal; AuthError when it is malformed, unknown or revoked."""
        parts = key.split("-", 2)
        if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1]:
            raise AuthError("Incorrect API key provided. Keys look like uf-<id>-<secret>; create one with "
                            "`ultrafast keys create`.")
        rows = self.db.query("SELECT key_id, name, key_hash, tiers, tpm, revoked_at FROM api_keys WHERE key_id = ?",
                             (parts[1],))
        if not rows or not hmac.compare_digest(rows[0]["key_hash"], hash_key(key)):
            raise AuthError("Incorrect API key provided.")
        row = rows[0]
        if row["revoked_at"] is not None:
            raise AuthError("This API key has been revoked.", code="revoked_api_key")
        return Principal(key_id=row["key_id"], name=row["name"], tiers=frozenset(row["tiers"].split(",")),
                         tpm=row["tpm"])


def _record(row: dict) -> dict:
    return {"key_id": row["key_id"], "name": row["name"], "tiers": row["tiers"].split(","), "tpm": row["tpm"],
            "created_at": row["created_at"], "revoked_at": row["revoked_at"],
            "status": "revoked" if row["revoked_at"] is not None else "active"}


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def resolve_tier(requested: str | None, principal: Principal) -> str:
    """The tier to serve: as asked (403 if the key may not use it), `auto` = the best allowed."""
    if requested is None or requested in ("default",):
        requested = "standard"
    if requested not in TIER_CHOICES:
        raise InvalidRequest(f"service_tier must be one of standard, ultrafast, auto; got {requested!r}",
                             param="service_tier", code="invalid_value")
    if requested == "auto":
        return "ultrafast" if "ultrafast" in principal.tiers else "standard"
    if requested not in principal.tiers:
        if requested == "ultrafast":
            raise TierNotEntitled(
                "This API key is not entitled to the ultrafast tier, which is sold separately. Use "
                "service_tier 'standard' (or 'auto'), or ask for a key with the ultrafast tier.")
        raise TierNotEntitled(f"This API key is not entitled to the {requested} tier.")
    return requested
