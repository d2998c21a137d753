# ruff: noqa: N802, N816  (NVML's own names)
"""Test-only fake NVML for FIT scenario 12 (put first on ``PYTHONPATH`` by the harness).

One "GPU" whose uncorrected-ECC count is read from the file ``$CKPT_FIT_NVML_FILE``
(an integer; missing or empty: 0). The harness writes a burst there; the sidecar's
:class:`~ckpt_agent.flash.sidecar.health.GpuHealth` reads it like a real NVML counter.
XID events are not delivered (``nvmlEventSetWait_v2`` always times out).
"""

from __future__ import annotations

import os

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 8


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    return None


def nvmlShutdown() -> None:
    return None


def nvmlDeviceGetCount() -> int:
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetTotalEccErrors(handle: int, error_type: int, counter: int) -> int:
    del handle, error_type, counter
    try:
        with open(os.environ.get("CKPT_FIT_NVML_FILE", ""), encoding="ascii") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def nvmlEventSetCreate() -> object:
    return object()


def nvmlDeviceRegisterEvents(handle: int, events: int, event_set: object) -> None:
    del handle, events, event_set


def nvmlEventSetWait_v2(event_set: object, timeout_ms: int) -> None:
    del event_set, timeout_ms
    raise NVMLError("Timeout")


def nvmlEventSetFree(event_set: object) -> None:
    del event_set
