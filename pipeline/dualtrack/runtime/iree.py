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

from dualtrack.contract.plan import parameter_key
from dualtrack.errors import DeviceError

PARAM_SCOPE = "model"
# IREE driver name for each dualtrack device.
DRIVERS = {"cpu": "local-task", "cuda": "cuda"}

_runtime_lock = threading.Lock()
# The CUDA driver reads its flags when IREE first creates it, once per process.
_parsed_flags: tuple[str, ...] | None = None
# `--cuda_async_allocations=false` lets results be exported zero-copy through DLPack (FACTS 7).
BASE_CUDA_FLAGS = ("--cuda_async_allocations=false",)


def _parse_runtime_flags_once(extra: tuple[str, ...] = ()) -> None:
    """Runtime flags must be set before the first CUDA device is created (FACTS 7)."""
    global _parsed_flags
    import iree.runtime as rt

    flags = (*BASE_CUDA_FLAGS, *extra)
    with _runtime_lock:
        if _parsed_flags is None:
            try:
                rt.flags.parse_flags(*flags)
            except (RuntimeError, ValueError) as e:
                raise DeviceError(
                    f"IREE rejected the runtime flags {' '.join(extra)}: {str(e).splitlines()[0]} "
                    "(check DUALTRACK_IREE_FLAGS)"
                ) from e
            _parsed_flags = flags
        elif _parsed_flags != flags:
            raise DeviceError(
                f"IREE runtime flags are process-wide and already set to {' '.join(_parsed_flags)}; "
                f"one process cannot also use {' '.join(flags)}"
            )


def parameter_index(weights: Mapping[str, np.ndarray]):
    """An IREE parameter index over host arrays, keyed as the importer names them
    (:func:`dualtrack.contract.plan.parameter_key`). The arrays must outlive the index."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    for name, arr in weights.items():
        index.add_buffer(parameter_key(name), np.ascontiguousarray(arr))
    return index


@dataclass
class IreeDevice:
    """One IREE HAL device plus the VM instance that owns modules on it."""

    name: str  # "cpu" or "cuda"
    instance: object
    device: object

    @classmethod
    def create(
        cls, name: str, device_index: int = 0, *, allocators: tuple[str, ...] = (), flags: tuple[str, ...] = ()
    ) -> IreeDevice:
        """``allocators``: IREE device allocator specs layered over the base one (e.g. "caching");
        ``flags``: extra IREE runtime flags (CUDA only: they are process-wide)."""
        import iree.runtime as rt

        if name == "cuda":
            _parse_runtime_flags_once(flags)
        try:
            driver = rt.get_driver(DRIVERS[name])
            if name == "cuda":
                infos = driver.query_available_devices()
                if device_index >= len(infos):
                    raise DeviceError(
                        f"IREE sees {len(infos)} CUDA device(s); device_index {device_index} does not exist"
                    )
                device = driver.create_device(infos[device_index]["device_id"], allocators=list(allocators) or None)
            else:
                device = driver.create_default_device(allocators=list(allocators) or None)
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
        self.function = fn
        self.invoker = rt.FunctionInvoker(self.context, dev.device, fn)
        self.lock = threading.Lock()

    def __call__(self, *args):
        """Run synchronously: returns after the work is complete (FACTS 8)."""
        with self.lock:
            out = self.invoker(*args)
        return out if isinstance(out, tuple) else (out,)

    def call_views(self, *views) -> tuple:
        """The hot path of the CUDA engine: HAL buffer views in, HAL buffer views out, synchronous
        like ``__call__`` but without FunctionInvoker's argument packing and result wrapping (on a
        2-core host 39 instead of 63 us a call)."""
        import iree.runtime as rt

        args = rt.VmVariantList(len(views))
        for v in views:
            args.push_ref(v)
        rets = rt.VmVariantList(4)
        with self.lock:
            self.context.invoke(self.function, args, rets)
        return tuple(rets.get_as_object(i, rt.HalBufferView) for i in range(len(rets)))
