"""Attempt credentials: what a task worker sends to the scheduler in place of its node's key.

When the scheduler assigns an attempt to a node, it signs a credential for that attempt on that
node (``AssignTask.worker_credential``); the node's agent hands it to the attempt's worker, and
the worker never sees the node's key. A credential reads
``otw_<payload>.<signature>``: the payload is JSON ``{"t": task id, "a": attempt, "n": node id,
"o": task owner}`` in URL-safe base64, the signature its HMAC-SHA256 under a secret kept in the
state store (``signing_secrets``), so every scheduler on the store, a new leader after a failover
too, accepts it.

A credential carries no expiry: whether it may still write is decided on each call from the
task's state (:meth:`~opentinker_scheduler.state.client_api.ClientApi.attempt_refusal`). Once its
attempt ends, is requeued or moves to another node, its writes are refused.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from opentinker_common.signed_claims import decode_claims, encode_claims, signature

__all__ = ["AttemptScope", "WorkerCredentials", "CREDENTIAL_PREFIX", "InvalidCredential"]

#: Every attempt credential starts with this.
CREDENTIAL_PREFIX = "otw_"
#: Longest credential accepted: a payload of a task id, a node id and an owner, with room to spare.
MAX_CREDENTIAL_CHARS = 2048
_SECRET_NAME = "worker_credentials"


class InvalidCredential(ValueError):
    """Not an attempt credential this scheduler signed (malformed, or a wrong signature)."""


@dataclass(frozen=True)
class AttemptScope:
    """The attempt a credential was issued for."""

    task_id: str
    attempt: int
    node_id: str
    #: The task's owner: the worker reads what this owner may read.
    owner: str

    @property
    def artifact_prefix(self) -> str:
        """The artifact keys this attempt may write: ``tasks/<task>/a<attempt>/``."""
        return f"tasks/{self.task_id}/a{self.attempt}/"

    def describe(self) -> str:
        return f"attempt {self.attempt} of task {self.task_id} on node {self.node_id}"


class WorkerCredentials:
    """Issues and checks attempt credentials with one secret of the state store."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @classmethod
    def open(cls, store) -> WorkerCredentials:
        """The signer of ``store``: its secret, made (random, 256 bits) on the first start.
        Every scheduler on one store gets the same secret."""
        with store.batch():
            store.db.execute(
                "INSERT INTO signing_secrets (name, secret) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
                (_SECRET_NAME, secrets.token_hex(32)),
            )
        (secret,) = store.db.execute("SELECT secret FROM signing_secrets WHERE name=?", (_SECRET_NAME,)).fetchone()
        return cls(bytes.fromhex(secret))

    def _sign(self, payload: str) -> str:
        return signature(self._secret, payload)

    def issue(self, scope: AttemptScope) -> str:
        """The credential of ``scope``."""
        payload = encode_claims({"t": scope.task_id, "a": scope.attempt, "n": scope.node_id, "o": scope.owner})
        return f"{CREDENTIAL_PREFIX}{payload}.{self._sign(payload)}"

    def verify(self, credential: str) -> AttemptScope:
        """The scope a credential was issued for.

        Raises:
            InvalidCredential: malformed, too long, or not signed with this store's secret.
        """
        if not credential.startswith(CREDENTIAL_PREFIX) or len(credential) > MAX_CREDENTIAL_CHARS:
            raise InvalidCredential("not an otw_ credential")
        payload, _, signature = credential[len(CREDENTIAL_PREFIX) :].partition(".")
        if not payload or not hmac.compare_digest(signature, self._sign(payload)):
            raise InvalidCredential("wrong signature")
        try:
            doc = decode_claims(payload)
            scope = AttemptScope(str(doc["t"]), int(doc["a"]), str(doc["n"]), str(doc["o"]))
        except (ValueError, KeyError, TypeError):
            raise InvalidCredential("payload does not parse") from None
        return scope
