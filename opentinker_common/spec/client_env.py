"""Client-hosted environments (``env_id: client``, env kind ``gym``).

The environment is a user's :class:`~opentinker_client.Environment` subclass running in the user's
own process; ``RLClient`` serves it over ``opentinker.environment.v1.EnvironmentService`` and
the trainer calls it at ``endpoint``. Only these settings travel in the task spec — never code.

Kind ``gym``: every workload that runs on gymnasium environments (``full_rl`` PPO, the
``lora_finetune`` LM game) runs on a client-hosted one too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from opentinker_common.net.url import redact_userinfo
from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec.registry import register_env

__all__ = [
    "ClientEnvConfig",
    "parse_endpoint",
    "check_token",
    "TOKEN_MIN_LEN",
    "TOKEN_MAX_LEN",
    "ROOT_CERTIFICATES_MAX_BYTES",
]

# host:port with a DNS name, an IPv4 address or a bracketed IPv6 address.
_ENDPOINT = re.compile(
    r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?):(?P<port>[0-9]{1,5})$"
)


#: Bounds of an access token (``secrets.token_urlsafe(32)`` gives 43 characters).
TOKEN_MIN_LEN, TOKEN_MAX_LEN = 16, 256
_TOKEN = re.compile(r"^[A-Za-z0-9_-]*$")
#: Largest ``tls_root_certificates`` PEM text, in bytes (a CA bundle of a few certificates).
ROOT_CERTIFICATES_MAX_BYTES = 64 * 1024
_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----\s[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----")


def check_token(token: object, path: str) -> None:
    """Refuse an access token that is not ``""`` or 16..256 url-safe characters (``A-Z a-z 0-9 _ -``).

    The message never contains the token itself (it is a secret).

    Raises:
        SpecError: naming ``path``.
    """
    if not isinstance(token, str):
        raise SpecError(
            path, f"a string of {TOKEN_MIN_LEN}..{TOKEN_MAX_LEN} url-safe characters, got a {type(token).__name__}"
        )
    if token == "":
        return
    if not _TOKEN.match(token):
        bad = sum(1 for c in token if not (c.isascii() and (c.isalnum() or c in "_-")))
        raise SpecError(
            path,
            f"url-safe characters only (A-Z a-z 0-9 _ -), as secrets.token_urlsafe() gives; "
            f"the token has {bad} other character(s)",
        )
    if not TOKEN_MIN_LEN <= len(token) <= TOKEN_MAX_LEN:
        raise SpecError(path, f"a token of {TOKEN_MIN_LEN}..{TOKEN_MAX_LEN} characters, got {len(token)} characters")


def parse_endpoint(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` string, or None when it is not one (port 1..65535)."""
    m = _ENDPOINT.match(endpoint) if isinstance(endpoint, str) else None
    if m is None:
        return None
    port = int(m.group("port"))
    if not 1 <= port <= 65535:
        return None
    return m.group("host"), port


@dataclass(frozen=True)
class ClientEnvConfig:
    """A client-hosted environment, as ``RLClient.submit_task`` describes it.

    Attributes:
        endpoint: ``host:port`` of the client's EnvironmentService, reachable from trainer nodes.
        action_space: number of discrete actions (``Discrete(n)``); required.
        observation_space: ``n`` of a ``Discrete(n)`` observation, or the number of floats of a
            flat ``Box`` observation (``observation_type: box``); required.
        observation_type: ``discrete`` (default) or ``box``.
        action_names: optional names of the actions (index i is action i), e.g.
            ``["left", "down", "right", "up"]``; a language model then answers with a name.
        timeout_s: seconds the trainer waits for one Reset/Step answer; past it the task FAILS
            naming the timeout.
        grace_s: seconds the trainer keeps retrying while the endpoint is unreachable (client
            gone, network) before the task FAILS.
        seed, max_episode_steps: as for gymnasium ids (first reset seed; time limit in steps).
        token: the access token of the client's EnvironmentServer; the trainer sends it as
            ``authorization: Bearer <token>`` on every call. ``""`` only for a server started
            with ``require_token=False`` (local experiments). 16..256 url-safe characters
            (``A-Z a-z 0-9 _ -``). RLClient fills it in. Secret: never printed in a repr or an
            error message, but stored with the task spec (readable by the task's owner and admins).
        tls: the server speaks TLS; the trainer dials it with ``grpc.secure_channel``.
        tls_root_certificates: PEM text of the CA certificate(s) that signed the server's
            certificate (at most 64 KiB); ``""`` trusts the system's roots. Only with ``tls``.
    """

    endpoint: str = field(default="", metadata={"max_len": 300})
    env_id: str = "client"
    action_space: int = num(0, 1, 1_000_000)
    observation_space: int = num(0, 1, 1_000_000)
    observation_type: str = field(default="discrete", metadata={"choices": ("discrete", "box")})
    action_names: tuple[str, ...] = ()
    timeout_s: float = num(30.0, 0.0, 3600.0, min_exclusive=True)
    grace_s: float = num(30.0, 0.0, 3600.0)
    seed: int | None = num(None, 0, 2**31 - 1)
    max_episode_steps: int | None = num(None, 1, 10_000_000)
    # Secret: repr=False, and _convert must never cut it into a message (check() bounds it).
    token: str = field(default="", repr=False, metadata={"max_len": 1 << 30})
    tls: bool = False
    tls_root_certificates: str = field(default="", repr=False, metadata={"max_len": 1 << 30, "multiline": True})

    def check(self, path: str) -> None:
        check_token(self.token, f"{path}.token")
        self._check_tls(path)
        if parse_endpoint(self.endpoint) is None:
            raise SpecError(
                f"{path}.endpoint",
                "host:port of the client's EnvironmentService, e.g. 127.0.0.1:50123 (RLClient sets it "
                "when you pass your Environment subclass to submit_task)",
                redact_userinfo(self.endpoint),  # never echo a user:password@ part
            )
        if self.action_space == 0:
            raise SpecError(
                f"{path}.action_space", "the number of discrete actions, an integer >= 1 (this key is required)"
            )
        if self.observation_space == 0:
            raise SpecError(
                f"{path}.observation_space",
                "the observation size, an integer >= 1 (n of Discrete(n), or the length of a Box vector; this "
                "key is required)",
            )
        if self.action_names:
            if len(self.action_names) != self.action_space:
                raise SpecError(
                    f"{path}.action_names", f"one name per action ({self.action_space} names)", list(self.action_names)
                )
            if len(set(n.strip().lower() for n in self.action_names)) != len(self.action_names) or not all(
                n.strip() and len(n) <= 64 for n in self.action_names
            ):
                raise SpecError(
                    f"{path}.action_names", "distinct non-empty names of at most 64 characters", list(self.action_names)
                )

    def _check_tls(self, path: str) -> None:
        roots = self.tls_root_certificates
        if not roots:
            return
        where = f"{path}.tls_root_certificates"
        if not self.tls:
            raise SpecError(where, "empty unless tls is true (the CA that signed the TLS server's certificate)")
        size = len(roots.encode("utf-8", "replace"))
        if size > ROOT_CERTIFICATES_MAX_BYTES:
            raise SpecError(where, f"PEM text of at most {ROOT_CERTIFICATES_MAX_BYTES} bytes, got {size} bytes")
        if not _PEM_CERT.search(roots):
            raise SpecError(
                where,
                "PEM text of a CA certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----), "
                "or empty to trust the system's roots",
                f"{roots[:40]}..." if len(roots) > 40 else roots,
            )
        if "PRIVATE KEY-----" in roots:
            raise SpecError(
                where, "certificates only: it contains a PRIVATE KEY block, which must never leave your machine"
            )


register_env(
    "client",
    ClientEnvConfig,
    kind="gym",
    description="an Environment subclass hosted by the submitting client (EnvironmentService)",
)
