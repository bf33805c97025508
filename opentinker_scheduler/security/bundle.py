"""The scheduler's security, assembled once: the key store, the limits, the audit log and the auth
interceptor, from the config's ``auth``, ``tls`` and ``limits`` (:func:`build_security`). The
server hands the one :class:`Security` to every servicer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opentinker_scheduler.config.limits import LimitsConfig
from opentinker_scheduler.security.audit import AuditLog
from opentinker_scheduler.security.auth import AuthInterceptor
from opentinker_scheduler.security.keys import KeyStore, bootstrap_admin
from opentinker_scheduler.security.limits import Limits
from opentinker_scheduler.state.store import StateStore
from opentinker_scheduler.state.worker_credentials import WorkerCredentials

__all__ = ["Security", "build_security"]


@dataclass
class Security:
    """Everything the servicers need for authentication, limits and audit."""

    keys: KeyStore | None  # None = authentication off
    limits: Limits
    audit: AuditLog
    interceptor: AuthInterceptor
    bootstrap_key_file: Path | None = None
    #: mTLS: a node's Register node_id must be its certificate's CN or a DNS name in it
    #: (``tls.node_id_must_match_cert``).
    node_id_must_match_cert: bool = False
    #: Signs and checks task workers' attempt credentials; None with authentication off.
    worker_credentials: WorkerCredentials | None = None

    @property
    def enabled(self) -> bool:
        return self.keys is not None


def build_security(config, store: StateStore) -> Security:
    """From a :class:`~opentinker_scheduler.config.SchedulerConfig` (its ``auth``, ``tls`` and
    ``limits``); makes the bootstrap admin key when auth is on and there is none.

    Call before group commit is enabled, so the bootstrap key is committed at once."""
    auth = getattr(config, "auth", None)
    tls = getattr(config, "tls", None)
    enabled = bool(auth is not None and auth.enabled)
    limits = Limits((getattr(config, "limits", None) or LimitsConfig()).resolved(auth_enabled=enabled))
    audit = AuditLog(store)
    keys = KeyStore(store, max_keys_per_owner=limits.config.max_keys_per_owner) if enabled else None
    written = None
    credentials = None
    if keys is not None:
        path = Path(auth.bootstrap_admin_key_file)
        written = bootstrap_admin(keys, path if path.is_absolute() else config.state_dir / path)
        credentials = WorkerCredentials.open(store)
    interceptor = AuthInterceptor(
        keys=keys,
        limits=limits,
        audit=audit,
        node_cert_required=bool(tls is not None and tls.node_cert_required),
        stream_recheck_interval_s=auth.stream_recheck_interval_s if auth is not None else 5.0,
        worker_credentials=credentials,
    )
    return Security(
        keys=keys,
        limits=limits,
        audit=audit,
        interceptor=interceptor,
        bootstrap_key_file=written,
        node_id_must_match_cert=bool(tls is not None and tls.node_id_must_match_cert),
        worker_credentials=credentials,
    )
