#!/usr/bin/env python3
"""``make gpu-check``: a GRPO task of SmolLM2-135M's shape on real NVIDIA GPUs, 1 GPU and all.

On a machine with NVIDIA GPUs (NVML and CUDA both working) it

1. builds a model of SmolLM2-135M-Instruct's shape with random weights (its ``config.json`` from
   ``.cache/models/SmolLM2-135M-Instruct`` when prepared, else the same numbers built in) and its
   tokenizer (the prepared folder's; required);
2. runs a ``lora_finetune`` GRPO task through the real worker (``python -m
   opentinker_trainer.worker``) on GPU 0 alone, then on every GPU (one NCCL rank per GPU),
   ``CUDA_VISIBLE_DEVICES`` by NVML UUID with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` as the node agent
   sets them, while a thread samples NVML every 0.2 s;
3. prints, per run: median step time (s), completion tokens/s of the global batch, mean and
   peak NVML utilization (%) and peak memory used (GiB) of each GPU the ranks used;
4. checks the GPU telemetry the scheduler shows: a real scheduler and one trainer node on
   loopback, a 1-GPU GRPO task, and ``ListNodes`` telemetry of the device the task was placed on
   must rise above its idle reading while the task runs (exit 1 when it does not).

Without a GPU it refuses at once, saying why, with exit code 2 (nothing is run).

    .venv/bin/python scripts/gpu_check.py [--steps N] [--skip-scheduler]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"

#: SmolLM2-135M's shape (its config.json), used when the prepared folder is absent.
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def refuse_without_gpu() -> list:
    """The NVML devices, or exit 2 with the reason when there is no usable NVIDIA GPU."""
    why = []
    devices = []
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        devices = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        if not devices:
            why.append("NVML found no GPU")
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound and friends
        why.append(f"NVML unavailable ({type(exc).__name__}: {exc})")
    import torch

    if not torch.cuda.is_available():
        why.append(f"torch {torch.__version__} sees no CUDA device (a CPU build, or no driver)")
    if why:
        print("gpu-check: refused: this check needs an NVIDIA GPU; " + "; ".join(why), file=sys.stderr)
        print("gpu-check: on a CPU machine, `make test` covers the distributed code with gloo ranks", file=sys.stderr)
        raise SystemExit(2)
    return devices


def model_folder(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not (MODEL_DIR / "tokenizer_config.json").exists():
        raise SystemExit(f"gpu-check: {MODEL_DIR} is not prepared (run `make install`): its tokenizer is needed")
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    shape = (
        json.loads((MODEL_DIR / "config.json").read_text()) if (MODEL_DIR / "config.json").exists() else SMOLLM2_135M
    )
    keys = set(SMOLLM2_135M) | {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}
    cfg = LlamaConfig(**{k: v for k, v in shape.items() if k in keys})
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


class Sampler(threading.Thread):
    """NVML utilization and memory of every GPU, every 0.2 s, until stopped."""

    def __init__(self, handles) -> None:
        super().__init__(daemon=True)
        self.handles, self.samples = handles, {i: [] for i in range(len(handles))}
        self.stop = threading.Event()

    def run(self) -> None:
        import pynvml

        while not self.stop.wait(0.2):
            for i, h in enumerate(self.handles):
                util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
                mem = pynvml.nvmlDeviceGetMemoryInfo(h).used
                self.samples[i].append((float(util), int(mem)))


def grpo_spec(model: Path, steps: int, gpus: int):
    from tests.support.distributed import task_spec

    hp = {
        "steps": steps,
        "prompts_per_step": 8 * gpus,  # 8 groups per rank
        "group_size": 8,
        "max_new_tokens": 32,
        "lora_rank": 16,
        "checkpoint_every": 0,
    }
    return task_spec(
        workload_type="lora_finetune",
        model=model,
        env_config={"env_id": "arithmetic"},
        hyperparameters=hp,
        gpu_count=gpus,
    )


def run_on(tmp: Path, model: Path, handles, gpus: int, steps: int) -> None:
    import subprocess

    import pynvml

    from opentinker.node.v1 import node_pb2
    from opentinker_trainer.devices import DeviceMonitor, cuda_visible_devices

    inventory = DeviceMonitor().inventory.devices
    folder = tmp / f"gpus-{gpus}"
    folder.mkdir()
    assign = node_pb2.AssignTask(
        task_id=f"gpu-check-{gpus}", attempt=1, spec=grpo_spec(model, steps, gpus), device_indices=list(range(gpus))
    )
    (folder / "a.pb").write_bytes(assign.SerializeToString())
    env = {
        **os.environ,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": cuda_visible_devices(inventory, range(gpus)),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'protos'}",
    }
    sampler = Sampler(handles)
    sampler.start()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "opentinker_trainer.worker",
            str(folder / "a.pb"),
            "--checkpoint-dir",
            str(folder / "c"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=folder,
    )
    sampler.stop.set()
    sampler.join()
    reports = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    metrics = [r["values"] for r in reports if r["type"] == "metric"][1:]
    if proc.returncode != 0 or not metrics:
        raise SystemExit(f"gpu-check: the {gpus}-GPU run failed:\n{proc.stderr[-4000:]}")
    print(
        f"{gpus} GPU(s): step {statistics.median(m['perf/step_s'] for m in metrics):.3f} s, "
        f"{statistics.median(m['perf/tokens_per_s'] for m in metrics):.0f} completion tokens/s"
    )
    for i in range(gpus):
        s = sampler.samples[i]
        name = pynvml.nvmlDeviceGetName(handles[i])
        print(
            f"  GPU {i} ({name}): utilization mean {statistics.mean(u for u, _ in s):.0f}% peak "
            f"{max(u for u, _ in s):.0f}%, peak memory {max(m for _, m in s) / 2**30:.2f} GiB"
        )


def scheduler_telemetry_rises(tmp: Path, model: Path, steps: int) -> bool:
    from opentinker.common.v1 import common_pb2
    from opentinker.scheduler.v1 import scheduler_pb2

    from tests.support.procs import Cluster

    (tmp / "cluster").mkdir(exist_ok=True)
    cluster = Cluster(tmp / "cluster", "heartbeat_interval: 0.5\nlease: 10\n")
    try:
        cluster.start_scheduler()
        cluster.start_trainer("gpu-check-node")
        (node,) = cluster.wait_nodes(1, timeout=120)
        idle = {t.index: t.utilization_percent for t in node.telemetry}
        task_id = cluster.stub.SubmitTask(
            scheduler_pb2.SubmitTaskRequest(spec=grpo_spec(model, steps * 4, 1))
        ).task.task_id
        task = cluster.wait_state(task_id, {common_pb2.TASK_STATE_RUNNING}, timeout=600)
        device = task.device_indices[0]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            (node,) = [n for n in cluster.stub.ListNodes(scheduler_pb2.ListNodesRequest()).nodes if n.connected]
            now = {t.index: t.utilization_percent for t in node.telemetry}
            if now.get(device, 0.0) > idle.get(device, 0.0) + 5:
                print(f"scheduler telemetry: GPU {device} utilization {idle.get(device, 0):.0f}% -> {now[device]:.0f}%")
                return True
            time.sleep(0.5)
        print(f"scheduler telemetry: GPU {device} utilization never rose above {idle.get(device, 0):.0f}% + 5")
        return False
    finally:
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-scheduler", action="store_true", help="leave out step 4 (the telemetry check)")
    args = parser.parse_args()
    handles = refuse_without_gpu()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = model_folder(tmp / "smollm2-shape")
        run_on(tmp, model, handles, 1, args.steps)
        if len(handles) > 1:
            run_on(tmp, model, handles, len(handles), args.steps)
        if not args.skip_scheduler and not scheduler_telemetry_rises(tmp, model, args.steps):
            raise SystemExit(1)
    print("gpu-check: ok")


if __name__ == "__main__":
    main()
