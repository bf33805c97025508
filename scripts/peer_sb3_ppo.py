"""The stable-baselines3 peer of ``scripts/bench_ppo.py``: SB3 PPO on one seed, measured the way
the bench measures OpenTinker's PPO, printed as one JSON line.

Runs in its own interpreter (a venv with stable-baselines3; OpenTinker is not imported here):

    python3 -m venv /work/peer-venv
    /work/peer-venv/bin/pip install torch==2.13.0 stable-baselines3==2.9.2 gymnasium
    /work/peer-venv/bin/python scripts/peer_sb3_ppo.py --config '{"env_id": "CartPole-v1", ...}'

``--config`` (JSON): ``env_id``, ``n_envs``, ``n_timesteps``, ``seed``, ``threshold``, ``window``,
``stop_at_threshold`` and ``ppo``: keyword arguments of ``stable_baselines3.PPO`` as
rl-baselines3-zoo's ``hyperparams/ppo.yml`` writes them, where a string ``"lin_<x>"`` is the zoo's
linear schedule ``progress_remaining * x`` (``rl_zoo3.utils.linear_schedule``).

Measured (as in the bench): after each rollout (``num_envs * n_steps`` env steps), the mean return
of the last ``window`` finished episodes (Monitor's ``info["episode"]["r"]``, in step order, then
env order); the first rollout end where ``window`` episodes have finished and that mean is
``>= threshold`` is the hit (env steps, seconds since the model was built). ``random`` is the mean
return of the episodes finished in the first rollout. One torch thread, like OpenTinker's trainer.

Output: ``{"seed", "hit_steps", "hit_s", "steps", "wall_s", "random", "final", "sb3", "torch",
"session"}``; ``session`` is the process's session id, which the bench records to show each side
ran in a session of its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque


def _schedule(value):
    if isinstance(value, str) and value.startswith("lin_"):
        start = float(value[4:])
        return lambda progress_remaining: progress_remaining * start
    return value


def run(cfg: dict) -> dict:
    import stable_baselines3
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)
    window, threshold = int(cfg["window"]), float(cfg["threshold"])
    state = {"hit": None, "random": math.nan, "final": math.nan, "rollouts": 0}

    class Threshold(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.recent: deque[float] = deque(maxlen=window)
            self.first: list[float] = []
            self.stop = False

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                ep = info.get("episode")
                if ep is not None:
                    self.recent.append(float(ep["r"]))
                    if state["rollouts"] == 0:
                        self.first.append(float(ep["r"]))
            return not self.stop

        def _on_rollout_end(self) -> None:
            if state["rollouts"] == 0 and self.first:
                state["random"] = sum(self.first) / len(self.first)
            state["rollouts"] += 1
            if self.recent:
                state["final"] = sum(self.recent) / len(self.recent)
            full = len(self.recent) == window
            if state["hit"] is None and full and state["final"] >= threshold:
                state["hit"] = (int(self.num_timesteps), time.perf_counter() - started)
                self.stop = bool(cfg.get("stop_at_threshold"))

    kwargs = {k: _schedule(v) for k, v in cfg["ppo"].items()}
    policy = kwargs.pop("policy", "MlpPolicy")
    started = time.perf_counter()
    env = make_vec_env(cfg["env_id"], n_envs=int(cfg["n_envs"]), seed=int(cfg["seed"]))
    model = PPO(policy, env, seed=int(cfg["seed"]), device="cpu", verbose=0, **kwargs)
    callback = Threshold()
    model.learn(total_timesteps=int(float(cfg["n_timesteps"])), callback=callback)
    wall = time.perf_counter() - started
    env.close()
    hit_steps, hit_s = state["hit"] if state["hit"] else (None, None)
    return {
        "seed": int(cfg["seed"]),
        "hit_steps": hit_steps,
        "hit_s": hit_s,
        "steps": int(model.num_timesteps),
        "wall_s": wall,
        "random": state["random"],
        "final": state["final"],
        "sb3": stable_baselines3.__version__,
        "torch": torch.__version__,
        "session": os.getsid(0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="JSON, see the module docstring")
    args = parser.parse_args(argv)
    print(json.dumps(run(json.loads(args.config))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
