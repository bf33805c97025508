"""Workers name their GPUs by NVML UUID."""

from __future__ import annotations

from opentinker.common.v1 import common_pb2
from opentinker_trainer.devices import cuda_visible_devices


def test_assigned_indices_become_uuids_in_their_order() -> None:
    devices = [common_pb2.Device(index=i, uuid=f"GPU-{i}aaa") for i in range(4)]
    assert cuda_visible_devices(devices, [3, 1]) == "GPU-3aaa,GPU-1aaa"
    assert cuda_visible_devices(devices, []) == ""


def test_an_index_without_a_uuid_stays_a_number() -> None:
    devices = [common_pb2.Device(index=0, uuid="GPU-x"), common_pb2.Device(index=1)]
    assert cuda_visible_devices(devices, [0, 1, 7]) == "GPU-x,1,7"
