"""The ``auth:`` section (what each key means: :mod:`opentinker_scheduler.security.auth`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AuthConfig:
    """The ``auth:`` section."""

    enabled: bool = False
    bootstrap_admin_key_file: str = "admin.key"
    #: Seconds between re-checks of the keys of open streams (expiry at the end of a rotation's
    #: grace period, revocation by any path); revocation through AdminService ends them at once.
    stream_recheck_interval_s: float = 5.0


def parse_auth(r, node) -> AuthConfig:
    """Parse ``auth:`` with the config reader ``r`` (file:line:key errors)."""
    m = r.mapping(node, "auth", {"enabled": "", "bootstrap_admin_key_file": "", "stream_recheck_interval": ""})
    kw = {}
    if "enabled" in m:
        kw["enabled"] = r.scalar(m["enabled"][1], "auth.enabled", bool)
    if "bootstrap_admin_key_file" in m:
        path = r.scalar(m["bootstrap_admin_key_file"][1], "auth.bootstrap_admin_key_file", str)
        if not path or len(path) > 4096:
            raise r.fail(m["bootstrap_admin_key_file"][1], "auth.bootstrap_admin_key_file", "a file path")
        kw["bootstrap_admin_key_file"] = path
    if "stream_recheck_interval" in m:
        kw["stream_recheck_interval_s"] = r.scalar(
            m["stream_recheck_interval"][1], "auth.stream_recheck_interval", float, 0.05, 3600
        )
    return AuthConfig(**kw)
