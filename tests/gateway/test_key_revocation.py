"""A key revoked at the scheduler stops working through the gateway within seconds: the unmodified
SDK's next training request with it is refused 401, while another owner's key keeps working.
Real processes with authentication on: scheduler, one trainer, the gateway."""

from __future__ import annotations

import contextlib

import tinker
from tinker import types

from opentinker_client import RLClient
from tests.support.gateway import MODEL_NAME, auth_world
from tests.support.waiting import wait_for

#: Seconds a training request may take to answer.
ANSWERED_S = 120


def _prefix(sdk_key: str) -> str:
    """The key prefix (``otk_<8 hex>``) of an SDK key ``tml-otk_<8 hex>_<secret>``."""
    return "_".join(sdk_key.removeprefix("tml-").split("_")[:2])


def _step(training: tinker.TrainingClient) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
    )
    training.forward_backward([datum], "cross_entropy").result(timeout=ANSWERED_S)


def test_a_revoked_key_is_refused_within_seconds_and_another_owners_key_works_on(
    tmp_path, tiny_model_dir, monkeypatch
) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with auth_world(tmp_path, tiny_model_dir) as w:
        alice = tinker.ServiceClient(base_url=w.gateway.url, api_key=w.alice)
        bob = tinker.ServiceClient(base_url=w.gateway.url, api_key=w.bob)
        try:
            training = alice.create_lora_training_client(base_model=MODEL_NAME, rank=2)
            _step(training)  # her key holds a grant on the gateway now
            bob_runs = bob.create_rest_client()
            bob_runs.list_training_runs().result(timeout=ANSWERED_S)
            with RLClient(w.cluster.url, api_key=w.admin.removeprefix("tml-")) as root:
                root.keys.revoke(_prefix(w.alice))

            def refused() -> Exception | None:
                """The refusal of a step: 401 on its request or, when the request got in before the
                gateway asked the scheduler again, on its future (the SDK raises ValueError then)."""
                try:
                    _step(training)
                except (tinker.AuthenticationError, tinker.PermissionDeniedError) as exc:
                    return exc
                except ValueError as exc:
                    if "with status 401" not in str(exc):
                        raise
                    return exc
                return None

            exc = wait_for(refused, timeout=60, interval=1.0, what="alice's revoked key to be refused by the gateway")
            assert "Error code: 401" in str(exc) and "revoked" in str(exc), exc
            assert bob_runs.list_training_runs().result(timeout=ANSWERED_S).training_runs == []
        finally:
            bob.close("success").result(timeout=ANSWERED_S)
            with contextlib.suppress(tinker.AuthenticationError):  # finishing her session is refused too
                alice.close("success").result(timeout=ANSWERED_S)
