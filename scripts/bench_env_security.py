"""What the access token and TLS cost a client-hosted environment: Step calls per second from the
trainer's RemoteSession to an EnvironmentServer on loopback, in three set-ups measured in the same
run, reported as ratios to the first (no token, plaintext):

* ``open``: ``require_token=False``, plaintext (the baseline; local experiments only);
* ``token``: the default, bearer token checked on every call, plaintext;
* ``token+tls``: token and TLS (certificates made with ``cryptography`` for 127.0.0.1).

Each set-up runs ``--rounds`` rounds of ``--calls`` sequential Step calls (one env, a trivial
environment, so the figure is the per-call overhead); the best round counts.

    .venv/bin/python scripts/bench_env_security.py [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opentinker_client import Environment  # noqa: E402
from opentinker_client.hosting.server import EnvironmentServer  # noqa: E402
from opentinker_common.spec import validate_env_config  # noqa: E402
from opentinker_trainer.envs.remote import close_all_sessions, make_client_env  # noqa: E402


class Ring(Environment):
    """Positions 0..9 on a ring; never ends (so every call is a plain Step)."""

    def __init__(self):
        super().__init__(action_space=2, observation_space=10)
        self.pos = 0

    def reset(self, seed=None):
        self.pos = 0
        return 0

    def step(self, action):
        self.pos = (self.pos + 1 + action) % 10
        return self.pos, 0.0, False, False, {}


def calls_per_s(server: EnvironmentServer, calls: int, rounds: int) -> float:
    env = make_client_env(validate_env_config(server.env_config), seed=None)
    env.reset()
    for _ in range(50):  # warm up the channel
        env.step(1)
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            env.step(1)
        best = max(best, calls / (time.perf_counter() - t0))
    close_all_sessions()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from tests.support.security import make_certs

    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp))
        setups = {
            "open": dict(require_token=False),
            "token": {},
            "token+tls": dict(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_ca=certs.ca),
        }
        results = {}
        for name, kw in setups.items():
            with EnvironmentServer(Ring(), **kw) as server:
                results[name] = calls_per_s(server, args.calls, args.rounds)
    base = results["open"]
    print(f"Step calls/s, one env, loopback, best of {args.rounds} x {args.calls} calls")
    for name, value in results.items():
        print(f"  {name:10s} {value:8.0f} calls/s  ratio to open: {value / base:.3f}")


if __name__ == "__main__":
    main()
