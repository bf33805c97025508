"""The ``limits:`` section (what each key means: :mod:`opentinker_scheduler.security.limits`, which
enforces them)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024

#: Defaults with authentication on (per-caller limits) and always (sizes).
DEFAULTS = {
    "max_message_bytes": 64 * MiB,
    "max_spec_bytes": 256 * 1024,
    "max_pending_per_owner": 1000,
    "submit_rate": 10.0,
    "submit_burst": 50,
    "read_rate": 100.0,
    "read_burst": 200,
    "rate_wait": 1.0,
    "max_streams_per_owner": 32,
    "max_calls_per_owner": 8,
    "spec_check_timeout": 10.0,
    "max_keys_per_owner": 20,
    "max_submits_in_flight": 64,
    "max_submit_wait": 0.5,
    "max_uploads": 64,
    "max_uploads_per_owner": 4,
    "max_checkpoint_uploads": 64,
    "max_checkpoint_uploads_per_node": 16,
    "max_checkpoint_uploads_per_attempt": 2,
    "upload_idle_timeout": 60.0,
    "upload_deadline": 3600.0,
    "max_dataset_bytes_per_owner": 10 * 1024 * MiB,
    "min_free_disk_bytes": 1024 * MiB,
}
_PER_CALLER = (
    "max_pending_per_owner",
    "submit_rate",
    "submit_burst",
    "read_rate",
    "read_burst",
    "max_streams_per_owner",
    "max_calls_per_owner",
    "max_uploads_per_owner",
    "max_dataset_bytes_per_owner",
)


@dataclass(frozen=True)
class LimitsConfig:
    """The ``limits:`` section as written; ``None`` = the default for the auth mode
    (:meth:`resolved`)."""

    max_message_bytes: int | None = None
    max_spec_bytes: int | None = None
    max_pending_per_owner: int | None = None
    submit_rate: float | None = None
    submit_burst: int | None = None
    read_rate: float | None = None
    read_burst: int | None = None
    rate_wait: float | None = None
    max_streams_per_owner: int | None = None
    max_calls_per_owner: int | None = None
    spec_check_timeout: float | None = None
    max_keys_per_owner: int | None = None
    max_submits_in_flight: int | None = None
    max_submit_wait: float | None = None
    max_uploads: int | None = None
    max_uploads_per_owner: int | None = None
    max_checkpoint_uploads: int | None = None
    max_checkpoint_uploads_per_node: int | None = None
    max_checkpoint_uploads_per_attempt: int | None = None
    upload_idle_timeout: float | None = None
    upload_deadline: float | None = None
    max_dataset_bytes_per_owner: int | None = None
    min_free_disk_bytes: int | None = None

    def resolved(self, *, auth_enabled: bool) -> "LimitsConfig":
        """Every field filled: the written value, else the default (0 = no limit for per-caller
        limits when authentication is off)."""
        values = {}
        for name, default in DEFAULTS.items():
            value = getattr(self, name)
            if value is None:
                value = default if auth_enabled or name not in _PER_CALLER else 0
            values[name] = value
        return LimitsConfig(**values)


_KEYS = {
    # key: (kind, lo, hi)
    "max_message_bytes": (int, 64 * 1024, 2**31 - 1),
    "max_spec_bytes": (int, 1024, 64 * MiB),
    "max_pending_per_owner": (int, 0, 10_000_000),
    "submit_rate": (float, 0, 1e6),
    "submit_burst": (int, 1, 1_000_000),
    "read_rate": (float, 0, 1e6),
    "read_burst": (int, 1, 1_000_000),
    "rate_wait": (float, 0, 60),
    "max_streams_per_owner": (int, 0, 100_000),
    "max_calls_per_owner": (int, 0, 100_000),
    "spec_check_timeout": (float, 0.1, 600),
    "max_keys_per_owner": (int, 0, 1_000_000),
    "max_submits_in_flight": (int, 0, 1_000_000),
    "max_submit_wait": (float, 0, 600),
    "max_uploads": (int, 0, 100_000),
    "max_uploads_per_owner": (int, 0, 100_000),
    "max_checkpoint_uploads": (int, 0, 100_000),
    "max_checkpoint_uploads_per_node": (int, 0, 100_000),
    "max_checkpoint_uploads_per_attempt": (int, 0, 100_000),
    "upload_idle_timeout": (float, 0.1, 86_400),
    "upload_deadline": (float, 0.1, 7 * 86_400),
    "max_dataset_bytes_per_owner": (int, 0, 2**62),
    "min_free_disk_bytes": (int, 0, 2**62),
}


def parse_limits(r, node) -> LimitsConfig:
    """Parse the ``limits:`` mapping with the config reader ``r`` (file:line:key errors).

    Raises:
        ConfigError: unknown key, wrong type or out of range (via ``r``).
    """
    m = r.mapping(node, "limits", {k: "" for k in _KEYS})
    kw = {}
    for name, (kind, lo, hi) in _KEYS.items():
        if name in m:
            kw[name] = r.scalar(m[name][1], f"limits.{name}", kind, lo, hi)
    return LimitsConfig(**kw)
