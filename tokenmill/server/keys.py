"""Tenants and API keys in a SQLite file. Keys are stored as SHA-256 hashes (they are
long random secrets, so a fast hash is enough); the plaintext is shown once, at
creation, and never logged."""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

KEY_PREFIX = "tm-"
CLASSES = ("interactive", "batch")


@dataclass(frozen=True)
class TenantLimits:
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # prompt + output tokens per minute
    max_concurrency: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None  # per request: longer output ends with finish_reason "length"
    max_n: int | None = None
    max_work_tokens: int | None = None  # per request: prompt + output tokens
    work_budget_tokens: int | None = None  # per window, all requests together
    work_window_s: float = 3600.0
    spend_budget_usd: float | None = None
    spend_period_s: float = 86400.0
    spend_alarm_usd: float | None = None  # alarm when spend in the trailing window exceeds this
    spend_alarm_window_s: float = 3600.0
    spend_alarm_block: bool = False  # refuse new requests while the alarm is raised
    default_class: str = "interactive"
    capture: bool = False  # its requests are captured for replay on a server run with --capture keys
    allowed_classes: tuple[str, ...] = CLASSES
    # the models and LoRA adapters the key may name (None: all); others answer 404, as unknown ones
    allowed_models: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None and v <= 0:
                raise ValueError(f"{f.name} must be positive, got {v}")
        if self.default_class not in CLASSES or not set(self.allowed_classes) <= set(CLASSES):
            raise ValueError(f"request classes are {CLASSES}")
        if self.default_class not in self.allowed_classes:
            raise ValueError(f"default class {self.default_class!r} is not among the allowed classes")


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits
    admin: bool = False  # sees every tenant in /v1/stats (the console's dashboard)


@dataclass(frozen=True)
class KeyInfo:
    key_id: int
    tenant: str
    prefix: str  # the first characters, to tell keys apart in listings
    created: float
    revoked: float | None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY, limits TEXT NOT NULL, created REAL NOT NULL,
    admin INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS keys (
    id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL REFERENCES tenants(name),
    key_hash TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL, created REAL NOT NULL, revoked REAL);
"""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _limits_to_text(limits: TenantLimits) -> str:
    import json

    return json.dumps(dataclasses.asdict(limits))


def _limits_from_text(text: str) -> TenantLimits:
    import json

    d = json.loads(text)
    d["allowed_classes"] = tuple(d.get("allowed_classes", CLASSES))
    if d.get("allowed_models") is not None:
        d["allowed_models"] = tuple(d["allowed_models"])
    known = {f.name for f in dataclasses.fields(TenantLimits)}
    return TenantLimits(**{k: v for k, v in d.items() if k in known})


class KeyStore:
    def __init__(self, path: str | Path):
        self.path = str(path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(tenants)")}
        if "admin" not in columns:  # a file written before admin keys existed
            self._db.execute("ALTER TABLE tenants ADD COLUMN admin INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        self._db.close()

    def set_busy_timeout(self, seconds: float) -> None:
        """How long a statement waits on another process's lock before 'database is locked'
        (sqlite3's own default: 5 s)."""
        self._db.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")

    def add_key(self, tenant: str, limits: TenantLimits | None = None, admin: bool | None = None) -> str:
        """Create (or update the limits of) a tenant and issue it a new key; returns the key.
        `admin` (when given) sets whether the tenant sees every tenant's stats."""
        if not tenant or len(tenant) > 100:
            raise ValueError("tenant names are 1-100 characters")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        with self._db:
            if limits is not None or self.tenant(tenant) is None:
                self._db.execute(
                    "INSERT INTO tenants(name, limits, created) VALUES (?, ?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET limits = excluded.limits",
                    (tenant, _limits_to_text(limits or TenantLimits()), now))
            if admin is not None:
                self._db.execute("UPDATE tenants SET admin = ? WHERE name = ?", (int(admin), tenant))
            self._db.execute("INSERT INTO keys(tenant, key_hash, prefix, created) VALUES (?, ?, ?, ?)",
                             (tenant, hash_key(key), key[:10], now))
        return key

    def tenant(self, name: str) -> Tenant | None:
        row = self._db.execute("SELECT name, limits, admin FROM tenants WHERE name = ?", (name,)).fetchone()
        return Tenant(row[0], _limits_from_text(row[1]), bool(row[2])) if row else None

    def authenticate(self, key: str) -> Tenant | None:
        row = self._db.execute(
            "SELECT t.name, t.limits, t.admin FROM keys k JOIN tenants t ON t.name = k.tenant "
            "WHERE k.key_hash = ? AND k.revoked IS NULL", (hash_key(key),)).fetchone()
        return Tenant(row[0], _limits_from_text(row[1]), bool(row[2])) if row else None

    def list_keys(self) -> list[KeyInfo]:
        rows = self._db.execute("SELECT id, tenant, prefix, created, revoked FROM keys ORDER BY id").fetchall()
        return [KeyInfo(*r) for r in rows]

    def tenants(self) -> list[Tenant]:
        rows = self._db.execute("SELECT name, limits, admin FROM tenants ORDER BY name").fetchall()
        return [Tenant(n, _limits_from_text(t), bool(a)) for n, t, a in rows]

    def revoke(self, *, key: str | None = None, key_id: int | None = None, tenant: str | None = None) -> int:
        """Revoke one key (by value or id) or every key of a tenant; returns how many."""
        now = time.time()
        with self._db:
            if key is not None:
                cur = self._db.execute("UPDATE keys SET revoked = ? WHERE key_hash = ? AND revoked IS NULL",
                                       (now, hash_key(key)))
            elif key_id is not None:
                cur = self._db.execute("UPDATE keys SET revoked = ? WHERE id = ? AND revoked IS NULL", (now, key_id))
            elif tenant is not None:
                cur = self._db.execute("UPDATE keys SET revoked = ? WHERE tenant = ? AND revoked IS NULL",
                                       (now, tenant))
            else:
                raise ValueError("revoke needs a key, a key id or a tenant")
        return cur.rowcount

    def has_keys(self) -> bool:
        return self._db.execute("SELECT 1 FROM keys WHERE revoked IS NULL LIMIT 1").fetchone() is not None
