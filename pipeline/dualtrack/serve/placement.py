"""Which device a serving process's engine runs on, as ``/readyz`` reports it (``"devices"``).

Reported for each model replica of ``--backend ray``: Ray picks a replica's GPU by setting
``CUDA_VISIBLE_DEVICES``, and no two replicas may land on one GPU. On ``cuda`` it says what the
CUDA driver says about the engine's context, so a deployment can prove that each engine owns one
GPU and no two share one: the device's name, PCI bus id and UUID (the UUID ``nvidia-smi`` prints),
the devices the process can see, which of them have an active primary context (one, the
engine's, when the process holds one primary context), and whether the engine runs in it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from dualtrack.errors import DualtrackError


def engine_placement(engine: Any) -> dict[str, Any]:
    """Where ``engine`` (a loaded :class:`~dualtrack.runtime.engine.Engine`) runs, from this process."""
    where: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": engine.device,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if engine.device != "cuda":
        return where
    try:
        where.update(_cuda_placement(engine.backend.device, engine.backend.ctx.handle))
    except DualtrackError as err:  # the driver answered an error: say so rather than fail the probe
        where["error"] = str(err)
    return where


def _cuda_placement(gpu: Any, context: Any) -> dict[str, Any]:
    """The engine's device (``gpu``: a :class:`~dualtrack.runtime.driver.Device`; ``context``: the
    engine's CUcontext) as the driver sees it."""
    from cuda.bindings import driver as cu

    from dualtrack.runtime.driver import call

    device = gpu.handle
    uuid = bytes(call(cu.cuDeviceGetUuid, device).bytes).hex()
    # Retaining the primary context hands back its handle (the engine holds one reference already,
    # so the release below never destroys it): is the engine's context that primary context?
    primary = call(cu.cuDevicePrimaryCtxRetain, device)
    try:
        is_primary = int(primary) == int(context)
    finally:
        call(cu.cuDevicePrimaryCtxRelease, device)
    visible = call(cu.cuDeviceGetCount)
    active = [i for i in range(visible) if call(cu.cuDevicePrimaryCtxGetState, call(cu.cuDeviceGet, i))[1]]
    return {
        "index": gpu.index,  # among the visible devices
        "name": gpu.name,
        "pci_bus_id": call(cu.cuDeviceGetPCIBusId, 64, device).split(b"\0", 1)[0].decode(),
        "uuid": f"GPU-{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:]}",
        "visible_devices": visible,
        "active_primary_contexts": active,
        "engine_context_is_primary": is_primary,
    }
