"""GPU telemetry from NVML (the ``nvidia-ml-py`` package, module ``pynvml``).

- **Which GPU.** A rank reads the GPU its torch device is, matched by UUID (``CUDA_VISIBLE_DEVICES``
  renumbers devices, NVML does not), falling back to the NVML index of the same number.
- **What.** Utilisation (% of the last sample period the GPU was busy), memory used (GiB) and power
  (W), read by the worker's heartbeat; the coordinator puts each rank's latest reading into the step
  metrics as ``gpu/util/<rank>``, ``gpu/mem_gib/<rank>`` and ``gpu/power_w/<rank>``.
- **Absent without noise.** On CPU, or where ``pynvml`` or the driver is missing, there is no
  telemetry and nothing is printed; a CUDA rank where NVML fails says so once, in one line.
- ``nvml_gpus()`` lists what NVML sees on this node, for ``--check`` and ``topology.json``.
"""

from __future__ import annotations

import sys
from typing import Any

GIB = 1 << 30


def _nvml() -> Any:
    """The initialised ``pynvml`` module, or None when it or the driver is missing."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no package, no driver, no GPU: no telemetry, by design silent
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_gpus() -> list[str]:
    """``"<index> <name>, <memory> GiB"`` for every GPU NVML sees on this node ([] without NVML)."""
    nv = _nvml()
    if nv is None:
        return []
    out = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h).total / GIB
            out.append(f"{i} {_text(nv.nvmlDeviceGetName(h))}, {mem:.0f} GiB")
    except Exception as e:  # a GPU that fails a query is reported, not fatal: --check is a diagnosis
        out.append(f"NVML error: {e}")
    return out


class GpuTelemetry:
    """Readings of one GPU; build with :meth:`open`."""

    def __init__(self, nvml: Any, handle: Any, index: int):
        self.nvml, self.handle, self.index = nvml, handle, index
        self.failed = False

    @classmethod
    def open(cls, device: str, rank: int) -> "GpuTelemetry | None":
        """Telemetry of torch ``device`` (``cuda`` or ``cuda:N``); None on CPU or without NVML."""
        if not device.startswith("cuda"):
            return None
        nv = _nvml()
        if nv is None:
            print(f"rank {rank}: no GPU telemetry: nvidia-ml-py (pynvml) or the NVML driver library is missing",
                  file=sys.stderr, flush=True)
            return None
        import torch
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            handle = nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:  # older drivers or torch without uuid: the index is right without CUDA_VISIBLE_DEVICES
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        return cls(nv, handle, index)

    def read(self) -> dict[str, float]:
        """{util, mem_gib, power_w}; empty after the first failed query (a lost GPU is reported elsewhere)."""
        if self.failed:
            return {}
        nv, h = self.nvml, self.handle
        try:
            util = nv.nvmlDeviceGetUtilizationRates(h).gpu
            mem = nv.nvmlDeviceGetMemoryInfo(h).used / GIB
            power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0        # milliwatts
        except Exception as e:
            self.failed = True
            print(f"GPU telemetry of cuda:{self.index} stopped: {e}", file=sys.stderr, flush=True)
            return {}
        return {"util": float(util), "mem_gib": round(mem, 3), "power_w": round(power, 1)}


def step_metrics(readings: dict[int, dict[str, float]]) -> dict[str, float]:
    """The step-metric keys of every rank's latest reading."""
    return {f"gpu/{key}/{rank}": value for rank, r in sorted(readings.items()) for key, value in r.items()}
