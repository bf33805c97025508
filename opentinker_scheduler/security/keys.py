"""API keys in the scheduler's state store (SQLite or PostgreSQL): create, list, revoke, rotate, resolve.

Keys look like ``otk_<8 hex>_<43 url-safe characters>`` (256 random bits). The ``otk_<8 hex>``
prefix is stored in plain text to name the key; the whole key only as its SHA-256, compared with
:func:`hmac.compare_digest` (a fast hash is enough: the key is random, not a password). See
:mod:`opentinker_scheduler.security.auth` for roles and the interceptor.

Bounds on how many keys one owner can hold (the rates, streams and uploads of ``limits:`` count
per owner, so more keys add nothing to them):

* at most ``limits.max_keys_per_owner`` *active* keys (unrevoked, unexpired) per owner, counting
  every role; creating one more (also by an admin) or rotating with a grace period (which leaves
  the old key valid next to the new one) is RESOURCE_EXHAUSTED;
* a key is rotated at most once: rotating a key that already has a successor is
  FAILED_PRECONDITION naming the successor ("rotate that one"), so one key cannot be turned into
  many keys that all stay valid for the grace period.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from opentinker_common.spec import control_character_problem
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, SchedulerError
from opentinker_scheduler.state.store import StateStore
from opentinker_scheduler.state.worker_credentials import AttemptScope

log = structlog.get_logger("opentinker.scheduler")

ROLES = ("admin", "user", "node")
BOOTSTRAP_ENV = "OPENTINKER_BOOTSTRAP_ADMIN_KEY"

_KEY_RE = re.compile(r"^(otk_[0-9a-f]{8})_([A-Za-z0-9_-]{43})$")
_PREFIX_RE = re.compile(r"^otk_[0-9a-f]{8}$")
_OWNER_RE = re.compile(r"^[A-Za-z0-9._@-]{1,128}$")

# The api_keys table: opentinker_scheduler/state/schema.py (migrations of both store backends).


class Unauthenticated(SchedulerError):
    """UNAUTHENTICATED: no API key, or one that is unknown, revoked or expired."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the API key's owner and role (``anonymous`` admin with auth off)."""

    owner: str
    role: str
    key_prefix: str = ""
    #: Common name of the verified client certificate (mTLS), when there is one.
    peer_cn: str = ""
    #: DNS subject alternative names of that certificate.
    peer_dns: tuple[str, ...] = ()
    #: The task of an endpoint token (role ``endpoint``: :mod:`.endpoint_tokens`), else "".
    endpoint_task: str = ""
    #: Whether that token's API key is an admin's (it may then use any task's adapters).
    endpoint_admin: bool = False
    #: The attempt of a task worker's credential (role ``worker``), else None.
    attempt: AttemptScope | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True)
class KeyRow:
    prefix: str
    owner: str
    role: str
    description: str
    create_time: float
    revoke_time: float | None
    expire_time: float | None
    replaced_by: str
    key_hash: str = dataclasses.field(repr=False, default="")

    def active(self, now: float) -> bool:
        return self.revoke_time is None and (self.expire_time is None or now < self.expire_time)

    def refusal(self, now: float) -> str | None:
        """Why this key may not be used at ``now`` (revoked, or expired after a rotation), else None."""
        if self.revoke_time is not None:
            return f"API key {self.prefix} was revoked" + (
                f"; it was replaced by {self.replaced_by}" if self.replaced_by else ""
            )
        if self.expire_time is not None and now >= self.expire_time:
            return f"API key {self.prefix} expired after rotation; use {self.replaced_by}"
        return None


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_prefix(text: str, field: str = "prefix") -> str:
    """``otk_<8 hex>`` from a prefix or a full key.

    Raises:
        InvalidArgument: neither, naming ``field``.
    """
    m = _KEY_RE.match(text)
    if m:
        return m.group(1)
    if _PREFIX_RE.match(text):
        return text
    raise InvalidArgument(
        f"{field}: expected an API key prefix such as otk_0123abcd (or a whole key), got {text[:24]!r}"
    )


class KeyStore:
    """API keys in the ``api_keys`` table of the scheduler's database (hashes only)."""

    _COLS = "prefix, owner, role, description, create_time, revoke_time, expire_time, replaced_by, key_hash"

    def __init__(self, store: StateStore, *, clock=time.time, max_keys_per_owner: int = 20) -> None:
        """``max_keys_per_owner``: active keys one owner may hold (``limits.max_keys_per_owner``);
        0 = no limit."""
        self.store = store
        self.clock = clock
        self.max_keys_per_owner = max_keys_per_owner

    @staticmethod
    def _row(r) -> KeyRow:
        return KeyRow(*r)

    @staticmethod
    def _check(owner: str, role: str, description: str) -> None:
        if not isinstance(owner, str) or not _OWNER_RE.match(owner):
            raise InvalidArgument(
                f"owner: expected 1..128 characters of letters, digits and ._@-, got {str(owner)[:40]!r}"
            )
        if role not in ROLES:
            raise InvalidArgument(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
        if len(description) > 256:
            raise InvalidArgument(f"description: expected at most 256 characters, got {len(description)}")
        problem = control_character_problem(description)
        if problem is not None:
            raise InvalidArgument(f"description: expected text on one line without control characters, got {problem}")

    def _insert(self, api_key: str, owner: str, role: str, description: str, now: float) -> KeyRow:
        prefix = _KEY_RE.match(api_key).group(1)  # type: ignore[union-attr]
        with self.store.batch():
            self.store.db.execute(
                f"INSERT INTO api_keys ({self._COLS}) VALUES (?,?,?,?,?,NULL,NULL,'',?)",
                (prefix, owner, role, description, now, hash_key(api_key)),
            )
        return self.get(prefix)

    def active_count(self, owner: str) -> int:
        """Keys of ``owner`` (any role) that are neither revoked nor expired now."""
        (n,) = self.store.db.execute(
            "SELECT COUNT(*) FROM api_keys WHERE owner=? AND revoke_time IS NULL "
            "AND (expire_time IS NULL OR expire_time > ?)",
            (owner, self.clock()),
        ).fetchone()
        return int(n)

    def _check_cap(self, owner: str, hint: str = "revoke unused keys first") -> None:
        """Raises ResourceExhausted when ``owner`` already holds ``max_keys_per_owner`` active keys."""
        most = self.max_keys_per_owner
        if not most:
            return
        active = self.active_count(owner)
        if active >= most:
            raise ResourceExhausted(
                f"owner {owner!r} already has {active} active API key(s), the limit is {most} "
                f"(limits.max_keys_per_owner); {hint}"
            )

    def create(self, owner: str, role: str, description: str = "") -> tuple[KeyRow, str]:
        """Make a new key; returns its record and the full key (the only time it is seen).

        Raises:
            InvalidArgument: bad owner, role or description (field named).
            ResourceExhausted: ``owner`` already holds ``max_keys_per_owner`` active keys.
        """
        self._check(owner, role, description)
        self._check_cap(owner)
        return self._create(owner, role, description)

    def _create(self, owner: str, role: str, description: str) -> tuple[KeyRow, str]:
        for _ in range(8):
            api_key = f"otk_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"
            if self.find(_KEY_RE.match(api_key).group(1)) is None:  # type: ignore[union-attr]
                return self._insert(api_key, owner, role, description, self.clock()), api_key
        raise RuntimeError("could not find a free key prefix")  # pragma: no cover - 2**32 prefixes

    def import_key(self, api_key: str, owner: str, role: str, description: str = "") -> KeyRow:
        """Store a key made elsewhere (the bootstrap admin key from the environment).

        Raises:
            InvalidArgument: not ``otk_<8 hex>_<43 url-safe characters>``, or its prefix is taken.
        """
        self._check(owner, role, description)
        m = _KEY_RE.match(api_key)
        if not m:
            raise InvalidArgument(
                "api_key: expected otk_<8 hex>_<43 url-safe characters> (make one with `opentinker keys generate`)"
            )
        if self.find(m.group(1)) is not None:
            raise InvalidArgument(f"api_key: prefix {m.group(1)} is already in use")
        return self._insert(api_key, owner, role, description, self.clock())

    def find(self, prefix: str) -> KeyRow | None:
        r = self.store.db.execute(f"SELECT {self._COLS} FROM api_keys WHERE prefix=?", (prefix,)).fetchone()
        return self._row(r) if r else None

    def get(self, prefix: str, *, owner: str | None = None) -> KeyRow:
        """Raises NotFound (also for another owner's key when ``owner`` is given)."""
        row = self.find(prefix)
        if row is None or (owner is not None and row.owner != owner):
            raise NotFound(f"API key {prefix} not found")
        return row

    def list(self, *, owner: str | None = None, include_inactive: bool = False) -> list[KeyRow]:
        sql, args = f"SELECT {self._COLS} FROM api_keys", []
        if owner is not None:
            sql += " WHERE owner=?"
            args.append(owner)
        rows = [self._row(r) for r in self.store.db.execute(sql + " ORDER BY create_time, prefix", args)]
        now = self.clock()
        return rows if include_inactive else [r for r in rows if r.active(now)]

    def revoke(self, prefix: str, *, owner: str | None = None) -> KeyRow:
        """Revoke now. Idempotent. Raises NotFound."""
        row = self.get(prefix, owner=owner)
        if row.revoke_time is None:
            with self.store.batch():
                self.store.db.execute("UPDATE api_keys SET revoke_time=? WHERE prefix=?", (self.clock(), prefix))
        return self.get(prefix)

    def rotate(self, prefix: str, *, grace_s: float = 0.0, owner: str | None = None) -> tuple[KeyRow, str, KeyRow]:
        """A new key with the same owner and role; the old one stops now, or after ``grace_s``.

        Returns (new record, new full key, old record).

        A key is rotated at most once; with a grace period the owner briefly holds one more
        active key, which counts against ``max_keys_per_owner`` (a rotation without grace does
        not change the count and is always allowed).

        Raises:
            NotFound: no such key (or another owner's).
            FailedPrecondition: the key is revoked or expired already, or was already rotated to
                a successor that is still active (it is named: rotate that one).
            InvalidArgument: ``grace_s`` outside [0, 30 days].
            ResourceExhausted: ``grace_s`` > 0 and the owner already holds ``max_keys_per_owner``
                active keys.
        """
        if not 0 <= grace_s <= 30 * 86400:
            raise InvalidArgument(f"grace: expected 0 to 30 days, got {grace_s} s")
        old = self.get(prefix, owner=owner)
        now = self.clock()
        if old.replaced_by and old.active(now):
            successor = self.find(old.replaced_by)
            if successor is not None and successor.active(now):
                raise FailedPrecondition(f"API key {prefix} was already rotated to {old.replaced_by}; rotate that one")
            # Its successor was revoked (or has expired) while this key is still in its grace
            # period: rotating again is the way back to a working key, not a second live successor.
        if not old.active(now):
            raise FailedPrecondition(f"API key {prefix} is already revoked or expired; create a new key instead")
        if grace_s > 0:
            self._check_cap(
                old.owner,
                "a rotation with a grace period keeps the old key active next to the new one: "
                "rotate with grace 0, or revoke unused keys first",
            )
        with self.store.batch():
            new, api_key = self._create(old.owner, old.role, old.description)
            if grace_s > 0:
                self.store.db.execute(
                    "UPDATE api_keys SET expire_time=?, replaced_by=? WHERE prefix=?",
                    (now + grace_s, new.prefix, prefix),
                )
            else:
                self.store.db.execute(
                    "UPDATE api_keys SET revoke_time=?, replaced_by=? WHERE prefix=?", (now, new.prefix, prefix)
                )
        return new, api_key, self.get(prefix)

    def has_active_admin(self) -> bool:
        return any(r.role == "admin" for r in self.list())

    def resolve(self, api_key: str) -> Principal:
        """The principal of a full key.

        Raises:
            Unauthenticated: malformed, unknown, revoked or expired (the message says which,
                except that a wrong secret reads like an unknown key).
        """
        m = _KEY_RE.match(api_key)
        row = self.find(m.group(1)) if m else None
        if row is None or not hmac.compare_digest(row.key_hash, hash_key(api_key)):
            raise Unauthenticated(
                "unknown API key (expected otk_<prefix>_<secret> as issued by `opentinker keys create`)"
            )
        refusal = self._refusal_of(row)
        if refusal is not None:
            raise Unauthenticated(refusal)
        return Principal(row.owner, row.role, row.prefix)

    def _refusal_of(self, row: KeyRow) -> str | None:
        """:meth:`KeyRow.refusal`, not pointing to a successor that is no longer usable either."""
        now = self.clock()
        refusal = row.refusal(now)
        if refusal is not None and row.replaced_by and row.revoke_time is None:
            successor = self.find(row.replaced_by)
            if successor is None or not successor.active(now):
                return (
                    f"API key {row.prefix} expired after rotation, and its successor {row.replaced_by} "
                    "is revoked or expired too; ask an admin for a new key"
                )
        return refusal

    def refusal(self, prefix: str) -> str | None:
        """Why the key ``prefix`` may no longer be used now (revoked, expired, deleted), else None.
        Open streams are re-checked with this (:mod:`opentinker_scheduler.security.key_streams`)."""
        row = self.find(prefix)
        if row is None:
            return f"API key {prefix} no longer exists"
        return self._refusal_of(row)


def bootstrap_admin(keys: KeyStore, key_file: Path) -> Path | None:
    """Make sure an active admin key exists (auth on). Returns the file written, if any.

    Takes ``$OPENTINKER_BOOTSTRAP_ADMIN_KEY`` when set; otherwise writes a new key to
    ``key_file`` (mode 0600) before storing its hash, so a key is never stored that nobody has.
    """
    if keys.has_active_admin():
        return None
    from_env = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if from_env:
        row = keys.import_key(from_env, "admin", "admin", f"bootstrap (from ${BOOTSTRAP_ENV})")
        log.warning("bootstrap admin key taken from the environment", key_prefix=row.prefix, variable=BOOTSTRAP_ENV)
        return None
    api_key = f"otk_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (api_key + "\n").encode())
    finally:
        os.close(fd)
    try:
        row = keys.import_key(api_key, "admin", "admin", "bootstrap admin key")
    except BaseException:
        key_file.unlink(missing_ok=True)
        raise
    log.warning(
        "bootstrap admin key written; create real keys with it, then revoke it",
        path=str(key_file),
        key_prefix=row.prefix,
    )
    return key_file
