"""The ``store:`` section: where the scheduler keeps its state, and (PostgreSQL) how several
schedulers share it.

.. code-block:: yaml

    store:
      kind: sqlite              # the default: <state_dir>/scheduler.db, one scheduler
    # or, several schedulers behind a load balancer:
    store:
      kind: postgres
      dsn: "host=db port=5432 dbname=opentinker user=opentinker"   # libpq string or URI, no password
      password_env: OPENTINKER_DB_PASSWORD   # the password from this environment variable,
      # password_file: /run/secrets/db-password   # or from this file (one of the two, or neither)
      schema: public            # PostgreSQL schema holding the tables (made when missing)
      leader_lease: 10          # seconds a lease lasts without renewal (replacing a cut-off leader takes at most this)
      renew_interval: 2         # seconds between renewals (under a third of leader_lease)
      call_timeout: 10          # seconds one database call may take before it is abandoned
      synchronous_commit: true  # every commit waits for its WAL flush (survives a database crash);
                                # false: commits return before the flush, several times the submit
                                # rate on a slow disk, but a crash of the PostgreSQL server (not of
                                # a scheduler) may lose the last ~0.6 s of acknowledged writes

The password is never part of the config value, a log line or an error: :meth:`StoreConfig.password`
reads it when the store opens. With neither key, libpq's own ``PGPASSWORD`` / ``~/.pgpass`` apply.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

#: Keys a config may no longer name, and what to do instead: they are refused at start, so an old
#: config does not run with a setting silently dropped.
REMOVED_KEYS = {
    "flush": "no such key: it was removed, a group commit always sends its COMMIT from a committer thread; "
    "delete the line",
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_URI_PASSWORD = re.compile(r"^[a-z]+://[^/@]*:[^/@]*@")
_KV_PASSWORD = re.compile(r"(^|\s)password\s*=", re.IGNORECASE)


@dataclass(frozen=True)
class StoreConfig:
    """The ``store:`` section (times in seconds)."""

    kind: str = "sqlite"
    dsn: str = ""
    password_env: str = ""
    password_file: str = ""
    schema: str = "public"
    leader_lease_s: float = 10.0
    renew_interval_s: float = 2.0
    call_timeout_s: float = 10.0
    synchronous_commit: bool = True

    def password(self) -> str | None:
        """The database password from ``password_env`` or ``password_file`` (None: neither set).

        Raises:
            OSError: the variable is unset or empty, or the file cannot be read (named; the
                password never is).
        """
        if self.password_env:
            value = os.environ.get(self.password_env, "")
            if not value:
                raise OSError(f"store.password_env: environment variable {self.password_env} is not set or empty")
            return value
        if self.password_file:
            try:
                value = Path(self.password_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise OSError(
                    f"store.password_file: cannot read {self.password_file}: {getattr(exc, 'strerror', None) or exc}"
                ) from None
            if not value:
                raise OSError(f"store.password_file: {self.password_file} is empty")
            return value
        return None


def dsn_has_password(dsn: str) -> bool:
    """Whether a libpq connection string or URI carries a password."""
    try:
        from psycopg import conninfo

        return "password" in conninfo.conninfo_to_dict(dsn)
    except ImportError:  # pragma: no cover - psycopg is in the scheduler extra
        return bool(_URI_PASSWORD.match(dsn.strip()) or _KV_PASSWORD.search(dsn))
    except Exception:  # noqa: BLE001 - unparseable: the caller reports it
        return bool(_URI_PASSWORD.match(dsn.strip()) or _KV_PASSWORD.search(dsn))


def _dsn_error(dsn: str) -> str | None:
    try:
        from psycopg import conninfo
    except ImportError:  # pragma: no cover
        return None
    try:
        conninfo.conninfo_to_dict(dsn)
    except Exception as exc:  # noqa: BLE001 - psycopg.ProgrammingError
        return str(exc).splitlines()[0] if str(exc) else "not a libpq connection string"
    return None


def parse_store(r, node) -> StoreConfig:
    """Parse ``store:`` with the config reader ``r`` (``file:line:column: key: expected ...``).

    Raises:
        ConfigError: unknown or removed key, wrong type, a DSN with a password in it, both password keys,
            a DSN with kind sqlite or none with kind postgres, renew_interval too long for the
            lease (via ``r``).
    """
    keys = (
        "kind",
        "dsn",
        "password_env",
        "password_file",
        "schema",
        "leader_lease",
        "renew_interval",
        "call_timeout",
        "synchronous_commit",
    )
    for k, _ in node.value if isinstance(node, yaml.MappingNode) else ():
        if isinstance(k, yaml.ScalarNode) and k.value in REMOVED_KEYS:
            raise r.fail(k, f"store.{k.value}", REMOVED_KEYS[k.value])
    m = r.mapping(node, "store", {k: "" for k in keys})
    kw: dict = {}
    if "kind" in m:
        kind = r.scalar(m["kind"][1], "store.kind", str)
        if kind not in ("sqlite", "postgres"):
            raise r.fail(m["kind"][1], "store.kind", f"sqlite or postgres, got {kind!r}")
        kw["kind"] = kind
    kind = kw.get("kind", "sqlite")
    if "dsn" in m:
        dsn = r.scalar(m["dsn"][1], "store.dsn", str)
        if kind != "postgres":
            raise r.fail(m["dsn"][1], "store.dsn", "no dsn with kind sqlite (the database is <state_dir>/scheduler.db)")
        if dsn_has_password(dsn):
            raise r.fail(
                m["dsn"][1],
                "store.dsn",
                "a connection string without a password (give it with store.password_env or store.password_file)",
            )
        bad = _dsn_error(dsn)
        if bad:
            raise r.fail(m["dsn"][1], "store.dsn", f"a libpq connection string or postgresql:// URI ({bad})")
        kw["dsn"] = dsn
    elif kind == "postgres":
        raise r.fail(node, "store.dsn", "a libpq connection string with kind postgres (required)")
    for key in ("password_env", "password_file"):
        if key in m:
            if kind != "postgres":
                raise r.fail(m[key][1], f"store.{key}", "nothing with kind sqlite")
            value = r.scalar(m[key][1], f"store.{key}", str)
            if key == "password_env" and not _ENV_NAME.match(value):
                raise r.fail(m[key][1], "store.password_env", f"an environment variable name, got {value!r}")
            if key == "password_file" and not value:
                raise r.fail(m[key][1], "store.password_file", "a file path")
            kw[key] = value
    if "password_env" in kw and "password_file" in kw:
        raise r.fail(m["password_file"][1], "store.password_file", "only one of password_env and password_file")
    if "schema" in m:
        value = r.scalar(m["schema"][1], "store.schema", str)
        if not _SCHEMA_NAME.match(value):
            raise r.fail(m["schema"][1], "store.schema", f"a plain identifier (letters, digits, _), got {value!r}")
        kw["schema"] = value
    for key, lo, hi in (("leader_lease", 1.0, 300.0), ("renew_interval", 0.1, 100.0), ("call_timeout", 0.5, 600.0)):
        if key in m:
            kw[f"{key}_s"] = r.scalar(m[key][1], f"store.{key}", float, lo, hi)
    if "synchronous_commit" in m:
        kw["synchronous_commit"] = r.scalar(m["synchronous_commit"][1], "store.synchronous_commit", bool)
    cfg = StoreConfig(**kw)
    if cfg.renew_interval_s * 3 > cfg.leader_lease_s:
        where = m["renew_interval"][1] if "renew_interval" in m else m.get("leader_lease", (None, node))[1]
        raise r.fail(
            where,
            "store.renew_interval",
            f"at most a third of store.leader_lease ({cfg.leader_lease_s:g} s), got {cfg.renew_interval_s:g} s",
        )
    return cfg
