"""GPU discovery and telemetry from NVML (``nvidia-ml-py``), or simulated devices for tests; the
host's CPU and memory from psutil (:meth:`DeviceMonitor.host_telemetry`, every node).

Units: memory in bytes, temperature in degrees Celsius, power in watts (NVML gives milliwatts),
SM clock in MHz, utilization in percent. A field NVML cannot give (NotSupported, MIG devices,
no permission) is left out of the telemetry with the reason in ``unavailable`` — never 0.

Simulated devices (``--simulate-gpus N``) are marked ``simulated`` everywhere they show; their
telemetry is made up (idle values) and must not be read as a measurement.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from opentinker.common.v1 import common_pb2

SIMULATED_MEMORY_BYTES = 80 * 1024**3


@dataclass(frozen=True)
class Inventory:
    """Devices found at start. ``note`` says why there are none, when there are none."""

    devices: tuple[common_pb2.Device, ...]
    note: str = ""
    simulated: bool = False


class DeviceMonitor:
    """Finds devices once and reads their telemetry on demand (thread-safe)."""

    def __init__(self, *, simulate_gpus: int = 0, simulated_memory_bytes: int = SIMULATED_MEMORY_BYTES) -> None:
        """Find the devices: NVML's, or ``simulate_gpus`` simulated ones of ``simulated_memory_bytes`` each."""
        self._lock = threading.Lock()
        self._prime_cpu()
        self._nvml = None
        self._handles: list = []
        if simulate_gpus > 0:
            devices = tuple(
                common_pb2.Device(
                    index=i,
                    uuid=f"SIM-GPU-{i}",
                    name="Simulated GPU",
                    memory_total_bytes=simulated_memory_bytes,
                    simulated=True,
                )
                for i in range(simulate_gpus)
            )
            self.inventory = Inventory(
                devices, note=f"{simulate_gpus} simulated GPU(s) (--simulate-gpus)", simulated=True
            )
            return
        self.inventory = self._discover()

    def _prime_cpu(self) -> None:
        """The first CPU reading to compare the next with (see :meth:`_cpu_percent`)."""
        self._cpu_times = None
        try:
            import psutil

            self._cpu_times = psutil.cpu_times()
        except Exception:  # noqa: BLE001 - no psutil: host_telemetry says so
            pass

    def _cpu_percent(self) -> float:
        """Host CPU busy since the previous reading, % of all cores.

        Kept here, not in ``psutil.cpu_percent(interval=None)``: psutil keeps that previous
        reading per calling thread, and the heartbeat reads from whichever pool thread is free,
        so a fresh thread read 0 % on a busy host. Busy is all time but idle and iowait; on
        Linux guest time is already counted in user time, as psutil counts it.
        """
        import psutil

        def total(t) -> float:
            return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

        def idle(t) -> float:
            return t.idle + getattr(t, "iowait", 0.0)

        with self._lock:
            now = psutil.cpu_times()
            before, self._cpu_times = self._cpu_times or now, now
        elapsed = total(now) - total(before)
        if elapsed <= 0:
            return 0.0
        busy = elapsed - (idle(now) - idle(before))
        return round(min(100.0, max(0.0, 100.0 * busy / elapsed)), 1)

    def _discover(self) -> Inventory:
        try:
            import pynvml  # provided by nvidia-ml-py
        except ImportError:
            return Inventory((), note="nvidia-ml-py is not installed")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return Inventory((), note=f"NVML unavailable ({exc}); running as a CPU node")
        self._nvml = pynvml
        devices = []
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                self._handles.append(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                devices.append(
                    common_pb2.Device(
                        index=i,
                        uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                        name=name.decode() if isinstance(name, bytes) else name,
                        memory_total_bytes=int(mem.total),
                    )
                )
        except pynvml.NVMLError as exc:
            return Inventory(tuple(devices), note=f"NVML error while listing devices: {exc}")
        return Inventory(tuple(devices), note="" if devices else "NVML found no GPU; running as a CPU node")

    def telemetry(self) -> list[common_pb2.DeviceTelemetry]:
        """One reading per device. Missing fields are absent, with a reason."""
        if self.inventory.simulated:
            return [
                common_pb2.DeviceTelemetry(
                    index=d.index,
                    utilization_percent=0.0,
                    memory_used_bytes=0,
                    memory_total_bytes=d.memory_total_bytes,
                    simulated=True,
                    unavailable={
                        "temperature_c": "simulated device",
                        "power_w": "simulated device",
                        "sm_clock_mhz": "simulated device",
                        "ecc_errors": "simulated device",
                    },
                )
                for d in self.inventory.devices
            ]
        if self._nvml is None:
            return []
        nv = self._nvml
        out = []
        with self._lock:
            for d, h in zip(self.inventory.devices, self._handles):
                t = common_pb2.DeviceTelemetry(index=d.index)
                readers = {
                    "utilization_percent": lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
                    "memory_used_bytes": lambda: int(nv.nvmlDeviceGetMemoryInfo(h).used),
                    "memory_total_bytes": lambda: int(nv.nvmlDeviceGetMemoryInfo(h).total),
                    "temperature_c": lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                    "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                    "sm_clock_mhz": lambda: int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                    "ecc_errors": lambda: int(
                        nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
                    ),
                }
                for field, read in readers.items():
                    try:
                        setattr(t, field, read())
                    except nv.NVMLError as exc:
                        t.unavailable[field] = str(exc) or type(exc).__name__
                out.append(t)
        return out

    def host_telemetry(self) -> common_pb2.HostTelemetry:
        """CPU utilisation since the previous reading (% of all cores), logical CPUs and memory in
        use (total minus available) of this host, from psutil; what psutil cannot give is absent
        with the reason in ``unavailable``."""
        out = common_pb2.HostTelemetry()
        try:
            import psutil
        except ImportError:
            for name in ("cpu_utilization_percent", "cpu_count", "memory_used_bytes", "memory_total_bytes"):
                out.unavailable[name] = "psutil is not installed"
            return out
        readers = {
            "cpu_utilization_percent": self._cpu_percent,
            "cpu_count": lambda: int(psutil.cpu_count() or 0) or None,
        }
        for name, read in readers.items():
            try:
                value = read()
            except Exception as exc:  # noqa: BLE001 - a reading psutil cannot make stays absent
                out.unavailable[name] = str(exc) or type(exc).__name__
                continue
            if value is None:
                out.unavailable[name] = "psutil does not know"
            else:
                setattr(out, name, value)
        try:
            mem = psutil.virtual_memory()
            out.memory_total_bytes = int(mem.total)
            out.memory_used_bytes = int(mem.total - mem.available)
        except Exception as exc:  # noqa: BLE001
            out.unavailable["memory_used_bytes"] = out.unavailable["memory_total_bytes"] = str(exc) or "error"
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None


def cuda_visible_devices(devices, indices) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker given the devices ``indices`` (NVML indices) of this
    node's ``devices`` (the inventory): their NVML UUIDs (``GPU-...``, which CUDA accepts and which
    do not depend on enumeration order), comma-separated, in the order of ``indices``; an index the
    inventory does not know (or a device without a UUID) is given as its number. Set
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` beside it, so numbers mean what NVML's do."""
    by_index = {int(d.index): d.uuid for d in devices}
    return ",".join(by_index.get(int(i)) or str(int(i)) for i in indices)
