"""The node's host telemetry: psutil's readings, or every field absent with the reason; and the memory
simulated GPUs report."""

from __future__ import annotations

import builtins

import psutil

from opentinker_trainer.devices import DeviceMonitor


def test_host_telemetry_reads_psutil() -> None:
    h = DeviceMonitor(simulate_gpus=1).host_telemetry()
    assert h.cpu_count == psutil.cpu_count() and h.HasField("cpu_utilization_percent")
    assert h.memory_total_bytes == psutil.virtual_memory().total and not h.unavailable


def test_without_psutil_every_field_says_why(monkeypatch) -> None:
    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("no psutil")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    h = DeviceMonitor(simulate_gpus=1).host_telemetry()
    assert not h.HasField("cpu_utilization_percent") and not h.HasField("memory_used_bytes")
    assert set(h.unavailable.values()) == {"psutil is not installed"} and len(h.unavailable) == 4


def test_simulated_gpus_report_the_memory_they_are_given() -> None:
    """``--simulate-gpu-memory``: what each simulated GPU registers (and the scheduler places
    shared LoRA tenants against); the default is 80 GiB."""
    devices = DeviceMonitor(simulate_gpus=2, simulated_memory_bytes=3 * 2**30).inventory.devices
    assert [(d.memory_total_bytes, d.simulated) for d in devices] == [(3 * 2**30, True)] * 2
    assert DeviceMonitor(simulate_gpus=1).inventory.devices[0].memory_total_bytes == 80 * 2**30


def test_cpu_reads_busy_from_any_thread_on_a_busy_host() -> None:
    """The heartbeat reads from whichever pool thread is free; a thread's first reading must not
    say 0 % while the host is busy (psutil keeps its previous reading per thread)."""
    import subprocess
    import sys
    import threading
    import time

    monitor = DeviceMonitor(simulate_gpus=1)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(1.0)  # a whole core busy since well before the next reading
        got: list[float] = []
        reader = threading.Thread(target=lambda: got.append(monitor.host_telemetry().cpu_utilization_percent))
        reader.start()
        reader.join(30)
    finally:
        busy.kill()
        busy.wait()
    cores = psutil.cpu_count() or 1
    assert got and got[0] >= 50.0 / cores, got
