"""Track B at run time: IREE modules with their weights supplied from the bundle's ONNX initializers.

Segments are compiled with externalized parameters (FACTS 11a), so a `.vmfb` holds code only and
every batch variant, CPU or CUDA, reads the same weights. Instead of shipping `.irpa` archives the
runtime builds the parameter index from the model's ONNX initializers, keyed by initializer name
in scope "model" (the names `iree-import-onnx --externalize-params` gives them).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dualtrack.errors import DeviceError

PARAM_SCOPE = "model"
# IREE driver name for each dualtrack device.
DRIVERS = {"cpu": "local-task", "cuda": "cuda"}

_runtime_lock = threading.Lock()
_flags_parsed = False


def _parse_runtime_flags_once() -> None:
    """Runtime flags must be set before the first CUDA device is created (FACTS 7).

    `--cuda_async_allocations=false` lets results be exported zero-copy through DLPack.
    """
    global _flags_parsed
    import iree.runtime as rt

    with _runtime_lock:
        if not _flags_parsed:
            rt.flags.parse_flags("--cuda_async_allocations=false")
            _flags_parsed = True


def parameter_index(weights: Mapping[str, np.ndarray]):
    """An IREE parameter index over host arrays. The arrays must outlive the index."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    for name, arr in weights.items():
        index.add_buffer(name, np.ascontiguousarray(arr))
    return index


@dataclass
class IreeDevice:
    """One IREE HAL device plus the VM instance that owns modules on it."""

    name: str  # "cpu" or "cuda"
    instance: object
    device: object

    @classmethod
    def create(cls, name: str, device_index: int = 0) -> IreeDevice:
        import iree.runtime as rt

        if name == "cuda":
            _parse_runtime_flags_once()
        try:
            driver = rt.get_driver(DRIVERS[name])
            if name == "cuda":
                infos = driver.query_available_devices()
                if device_index >= len(infos):
                    raise DeviceError(
                        f"IREE sees {len(infos)} CUDA device(s); device_index {device_index} does not exist"
                    )
                device = driver.create_device(infos[device_index]["device_id"])
            else:
                device = driver.create_default_device()
        except (RuntimeError, ValueError) as e:
            raise DeviceError(f"IREE could not open its {DRIVERS[name]} driver: {str(e).splitlines()[0]}") from e
        return cls(name, rt.VmInstance(), device)


class IreeModule:
    """A compiled segment loaded into its own VM context, callable with arrays or buffer views.

    The VM context is not thread-safe; calls are serialised by a lock (one module per engine,
    and the engine's callers share it).
    """

    def __init__(self, dev: IreeDevice, vmfb: Path, params, entry: str = "main_graph") -> None:
        import iree.runtime as rt

        self.dev = dev
        self.path = vmfb
        hal = rt.create_hal_module(dev.instance, dev.device)
        io_params = rt.create_io_parameters_module(dev.instance, params.create_provider(scope=PARAM_SCOPE))
        main = rt.VmModule.mmap(dev.instance, str(vmfb))
        self.context = rt.VmContext(dev.instance, modules=[hal, io_params, main])
        fn = main.lookup_function(entry)
        if fn is None:
            raise DeviceError(f"{vmfb.name} has no function '{entry}'; rebuild the bundle")
        self.invoker = rt.FunctionInvoker(self.context, dev.device, fn)
        self.lock = threading.Lock()

    def __call__(self, *args):
        """Run synchronously: returns after the work is complete (FACTS 8)."""
        with self.lock:
            out = self.invoker(*args)
        return out if isinstance(out, tuple) else (out,)
