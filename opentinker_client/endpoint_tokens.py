"""Endpoint tokens: the credential a task's endpoints on trainer nodes take, so API keys stay with
the scheduler.

An inference task's ``InferenceService`` and OpenAI-compatible HTTP API and a training session's
``TrainingService`` run on trainer nodes. They refuse API keys (``otk_...``); they take an endpoint
token (``ote_...``) that the scheduler issues for one task and one owner, which expires (default
one hour) and stops working when the API key that asked for it is revoked.
:class:`EndpointTokens` asks the scheduler for one with the connection's API key and asks again
before it expires; :class:`~opentinker_client.InferenceClient` and
:class:`~opentinker_client.TrainingSession` made by :class:`~opentinker_client.RLClient` use it,
so their users see no difference. For the ``openai`` package, print one with
``opentinker endpoint-token TASK`` and pass it as ``api_key``; without authentication there is
no token and any non-empty ``api_key`` works.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client.connection import SchedulerConnection
from opentinker_common.net.bearer import bearer_metadata

__all__ = ["DEFAULT_TTL_S", "EndpointToken", "EndpointTokens", "issue_endpoint_token"]

#: Seconds an endpoint token works unless asked otherwise (the scheduler allows 1 s to 24 h).
DEFAULT_TTL_S = 3600.0
#: A token is renewed once less than this share of its lifetime is left.
RENEW_SHARE = 0.25


@dataclass(frozen=True)
class EndpointToken:
    """``token`` (``ote_...``; ``""`` when the scheduler runs without authentication) and when it
    stops working (``expire_time``, unix seconds; 0 for none)."""

    token: str
    expire_time: float


def issue_endpoint_token(connection: SchedulerConnection, task_id: str, *, ttl: float = DEFAULT_TTL_S) -> EndpointToken:
    """A new endpoint token for the endpoints of task ``task_id``, valid ``ttl`` seconds.

    Raises:
        NotFoundError: no such task of the connection's owner. InvalidArgumentError: ``ttl``
        outside 1 s to 24 h. FailedPreconditionError: the task serves no endpoint.
    """
    request = scheduler_pb2.IssueEndpointTokenRequest(task_id=task_id)
    request.ttl.FromNanoseconds(int(ttl * 1e9))
    response = connection.unary("IssueEndpointToken", request, retry=False)
    expire = response.expire_time.ToNanoseconds() / 1e9 if response.HasField("expire_time") else 0.0
    return EndpointToken(response.token, expire)


class EndpointTokens:
    """The call metadata for the endpoints of task ``task_id``: a token from the scheduler,
    renewed when less than a quarter of its ``ttl`` is left. Thread-safe.

    Args:
        connection: the scheduler, with the API key that asks; it must stay open while the
            endpoint is used. Without an API key no token is asked for and none is sent.
        task_id: the inference or ``lora_session`` task whose endpoints are called.
        ttl: seconds each token works.
    """

    def __init__(
        self, connection: SchedulerConnection, task_id: str, *, ttl: float = DEFAULT_TTL_S, clock=time.time
    ) -> None:
        self.connection = connection
        self.task_id = task_id
        self.ttl = float(ttl)
        self.clock = clock
        self._lock = threading.Lock()
        self._current: EndpointToken | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """``(("authorization", "Bearer ote_..."),)``, or ``()`` when the connection has no key.

        Raises:
            OpenTinkerError: the scheduler refused a new token (the subclass for its status).
        """
        if not self.connection.api_key:
            return ()
        with self._lock:
            current = self._current
            if current is None or (current.expire_time and self.clock() > current.expire_time - self.ttl * RENEW_SHARE):
                current = self._current = issue_endpoint_token(self.connection, self.task_id, ttl=self.ttl)
        return bearer_metadata(current.token)
