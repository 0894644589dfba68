"""What every Track A kernel spec shares: the base class, the launch it describes, and the ABI checks.

A :class:`KernelSpec` answers everything about one CUDA source (``handwritten_ptx/<stem>.cu``):
its entries, its ``-D`` tile macros, its launch geometry, its ``cuLaunchKernel`` argument list
(the ABI of ``handwritten_ptx/README.md``), how its weights are packed, and its numpy reference.
:meth:`KernelSpec.prepare` puts these together for one call of a plan: the runtime hands it the
call's device tensors and a :class:`LaunchContext` (what only the runtime knows: which kernels
this device may run, tuned entries, the driver's tensor-map encoder) and launches what it gets.

This package never imports the runtime: the runtime depends on the kernels, and reaches back only
through the :class:`LaunchContext` it implements.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from dualtrack.contract.arch import PTX_ARCHES
from dualtrack.contract.plan import KernelCall
from dualtrack.errors import InputError

if TYPE_CHECKING:  # annotations only: the choice is made by a conv spec's policy (select.py)
    from dualtrack.kernels.device import DeviceInfo
    from dualtrack.kernels.select import ConvChoice
    from dualtrack.kernels.tensormap import TiledMap

DTYPES: dict[str, str] = {"float16": "f16", "float32": "f32"}  # numpy dtype name -> entry suffix
INT32_MAX = 2**31 - 1
GRID_Y_MAX = 65535

# (value, ctypes type) for cuLaunchKernel's kernelParams; (struct, None) passes a cuda.bindings
# struct such as a CUtensorMap by value. runtime/driver.py's kernel_params() turns a list of these
# into what cuda.bindings takes: it lives there because it is the one place that knows the packer.
KernelArg = tuple[Any, Any]


def dtype_name(dtype: Any) -> str:
    """Normalise ``"float16"``, ``np.float16`` or ``np.dtype("float16")`` to its numpy name."""
    try:
        name = np.dtype(dtype).name
    except TypeError as exc:
        raise InputError(f"dtype {dtype!r} is not a numpy dtype; Track A kernels take float16 or float32") from exc
    if name not in DTYPES:
        raise InputError(f"dtype {name} has no Track A kernel; use float16 or float32")
    return name


@dataclass(frozen=True)
class LaunchConfig:
    """Grid and block dimensions and dynamic shared memory of one kernel launch."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0


@dataclass(frozen=True)
class PreparedCall:
    """What :meth:`KernelSpec.prepare` answers for one call: the entry to launch, its geometry and
    its arguments (tensor maps included), and for a conv3x3 which implementation runs and why.
    ``before``: launches that run first, in order, on the same stream (a norm's statistics passes)."""

    entry: str
    config: LaunchConfig
    args: list[KernelArg]
    choice: ConvChoice | None = None
    before: tuple[PreparedCall, ...] = ()


class DeviceTensor(Protocol):
    """A tensor in device memory as the runtime holds it (runtime/gpu.py's GpuTensor)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def channel_stride(self) -> int: ...


class LaunchContext(Protocol):
    """What a spec needs from the runtime to prepare a launch, and only the runtime knows."""

    # Why conv3x3 may not run the Hopper (wgmma) kernel on this device, or None where it may.
    wgmma_off: str | None
    # The GPU launched on (runtime.driver.Device.info): what the conv chooser and grids plan for.
    device: DeviceInfo

    def tuned_entry(self, call: KernelCall, batch: int) -> str | None:
        """The tuned entry a `dualtrack tune` file chose for this call and batch size, or None."""
        ...

    def tensor_map(self, m: TiledMap) -> Any:
        """``m`` encoded by the driver (a ``CUtensorMap`` passed to the kernel by value)."""
        ...

    def workspace(self, nbytes: int) -> int:
        """The device address of ``nbytes`` of zeroed scratch memory for the launch being prepared
        (the wgmma conv's split-K partial sums and tile counters), kept as long as the launch."""
        ...


Tensors = Sequence[DeviceTensor]  # a call's inputs or weights, in the call's order


def weight_pointers(weights: Tensors) -> dict[str, int | None]:
    """``w`` and ``bias`` of :meth:`KernelSpec.args` from a call's packed weights and optional
    bias on the device (no bias: None, a null pointer)."""
    return {"w": weights[0].ptr, "bias": weights[1].ptr if len(weights) > 1 else None}


def typed(params: Sequence[str], pointers: int, values: Mapping[str, Any]) -> list[KernelArg]:
    """An entry's ABI list, for the entries whose parameters are not their spec's
    :attr:`KernelSpec.PARAMS` (a norm's statistics pass, split-K's sum): the first ``pointers``
    parameters ``c_void_p`` (None: null), ``eps``, ``p0``, ``p1`` ``c_float``, the rest ``c_int32``."""
    out: list[KernelArg] = []
    for i, name in enumerate(params):
        v = values[name]
        if i < pointers:
            out.append((int(v or 0), ctypes.c_void_p))
        elif name in ("eps", "p0", "p1"):
            out.append((float(v), ctypes.c_float))
        else:
            out.append((int(v), ctypes.c_int32))
    return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def positive(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{name}={value!r} must be a positive integer")


def stride(name: str, value: int | None, channels: int) -> int:
    if value is None:
        return channels
    if value < channels:
        raise InputError(
            f"{name}={value} is smaller than the {channels} channels it must hold; use {name} >= {channels}"
        )
    return int(value)


def pointer(name: str, value: int | None, *, required: bool = True) -> int:
    if value is None or value == 0:
        if required:
            raise InputError(f"{name} is a null device pointer")
        return 0
    return int(value)


def pixels(N: int, H: int, W: int, ld: int) -> int:
    # The kernels index pixels with 32-bit ints (element offsets are 64-bit).
    if N * H * W > INT32_MAX:
        raise InputError(f"N*H*W = {N * H * W} output pixels exceed 2^31-1; split the batch")
    if ld > INT32_MAX:
        raise InputError(f"channel stride {ld} exceeds 2^31-1")
    return N * H * W


def gemm_grid(M: int, K: int, bm: int, bn: int, z: int = 1) -> tuple[int, int, int]:
    """The grid of the GEMM-shaped kernels: pixel tiles along x, channel tiles along y."""
    grid_y = cdiv(K, bn)
    if grid_y > GRID_Y_MAX:
        raise InputError(f"K={K} output channels need {grid_y} channel tiles; the grid allows {GRID_Y_MAX}")
    return (cdiv(M, bm), grid_y, z)


@dataclass(frozen=True)
class KernelSpec:
    """One op's kernels (an fp16 and an fp32 entry in one source file)."""

    op: str
    stem: str  # handwritten_ptx/<stem>.cu; entries are <stem>_f16 and <stem>_f32

    # Kernel parameters in ABI order (handwritten_ptx/README.md): POINTERS device pointers first,
    # then int32s but the float32s in FLOATS. NULLABLE pointers may be null (an optional bias);
    # each pixel stride in STRIDES must hold the channel count it names (omitted: dense).
    PARAMS: ClassVar[tuple[str, ...]] = ()
    POINTERS: ClassVar[int] = 0
    FLOATS: ClassVar[frozenset[str]] = frozenset()
    NULLABLE: ClassVar[frozenset[str]] = frozenset()
    STRIDES: ClassVar[tuple[tuple[str, str], ...]] = ()
    # The PTX arches the source is compiled for (`make ptx`, ptx/<arch>/<stem>.ptx) and shipped in.
    ptx_arches: ClassVar[tuple[str, ...]] = PTX_ARCHES

    def entry(self, dtype: Any) -> str:
        """The kernel's symbol name for an activation dtype, e.g. ``conv3x3_nhwc_f16``."""
        return f"{self.stem}_{DTYPES[dtype_name(dtype)]}"

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self.entry(d) for d in DTYPES)

    @property
    def source(self) -> str:
        """The source stem (``handwritten_ptx/<source>.cu``, ``ptx/<arch>/<source>.ptx``)."""
        return self.stem

    def defines(self) -> dict[str, int | str]:
        """The ``-D`` macros the source is compiled with (tile and block sizes)."""
        raise NotImplementedError

    def threads(self, dtype: Any) -> int:
        """Threads per block of the entry for ``dtype`` (its ``__launch_bounds__``)."""
        raise NotImplementedError

    def output_shape(self, N: int, H: int, W: int, C: int, K: int = 0) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def launch(self, dtype: Any, N: int, H: int, W: int, C: int, K: int = 0) -> LaunchConfig:
        raise NotImplementedError

    def args(self, **kw: Any) -> list[KernelArg]:
        """The ABI's argument list (:attr:`PARAMS`) as (value, ctypes type) pairs, from values by
        parameter name (what :meth:`call_args` answers; the unnamed are ignored).

        Pointers are device addresses (ints), null only where :attr:`NULLABLE` (omitted: null);
        the :attr:`STRIDES` default to their channel counts (dense tensors); the kernel's own
        checks and the values it derives (output size, attributes) are :meth:`arg_values`';
        the other parameters (``N``, ``H``...) pass as given.
        """
        ld = {name: stride(name, kw.get(name), kw[channels]) for name, channels in self.STRIDES}
        own = self.arg_values({**kw, **ld})
        ptrs = {
            name: pointer(name, kw.get(name), required=name not in self.NULLABLE)
            for name in self.PARAMS[: self.POINTERS]
        }
        return self.typed({**kw, **ld, **ptrs, **own})

    def checked_output(self, kw: Mapping[str, Any]) -> tuple[int, int, int, int]:
        """:meth:`output_shape` of the input (``N, H, W, C``) and output channels (``K``) in
        :meth:`args`' values, having checked that the pixels and strides fit 32-bit indices."""
        out = self.output_shape(kw["N"], kw["H"], kw["W"], kw["C"], kw.get("K", 0))
        pixels(kw["N"], kw["H"], kw["W"], max(kw["ldx"], kw["ldy"]))
        return out

    def arg_values(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`args`' checks of the call's shape and attributes in ``kw`` (strides checked and
        filled in), and the parameters that are not passed as given, by name. By default
        :meth:`checked_output` and none."""
        self.checked_output(kw)
        return {}

    def reference(self, x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        raise NotImplementedError

    def call_args(self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors) -> dict[str, Any]:
        """The keyword arguments of :meth:`args` for one call on these tensors (``inputs`` in
        ``call.inputs`` order): the pointers (the packed weights' and bias's too, in
        :meth:`pack_weights`' order), the first input's shape, the output channels ``K`` and both
        pixel strides, and :meth:`call_attrs` (a spec with more inputs adds them)."""
        x = inputs[0]
        n, h, w, c = x.shape
        return {
            "x": x.ptr, "y": y.ptr,
            "N": n, "H": h, "W": w, "C": c, "K": y.shape[3],
            "ldx": x.channel_stride, "ldy": y.channel_stride,
            **(weight_pointers(weights) if weights else {}),
            **self.call_attrs(call),
        }  # fmt: skip

    def call_launch(self, dtype: Any, kw: Mapping[str, Any]) -> LaunchConfig:
        """:meth:`launch`'s geometry for :meth:`call_args`' values (a spec whose launch takes
        attributes too passes them)."""
        return self.launch(dtype, kw["N"], kw["H"], kw["W"], kw["C"], kw["K"])

    def prepare(
        self, call: KernelCall, x: DeviceTensor, y: DeviceTensor, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        """:meth:`prepare_inputs` of a call with the one input ``x``."""
        return self.prepare_inputs(call, [x], y, weights, ctx)

    def prepare_inputs(
        self, call: KernelCall, inputs: Tensors, y: DeviceTensor, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        """The launch of ``call`` reading ``inputs`` (in ``call.inputs`` order: what the runtime
        calls) and writing ``y`` (NHWC, possibly channel slices), with the device copies of its
        packed weights (:meth:`pack_weights`, in ``call.weights`` order): entry, geometry and
        arguments. By default the entry of the first input's dtype, :meth:`call_launch`'s geometry
        and :meth:`args` of :meth:`call_args`; a spec that chooses among entries or passes tensor
        maps prepares its own."""
        kw = self.call_args(call, inputs, y, weights)
        dtype = inputs[0].dtype
        return PreparedCall(self.entry(dtype), self.call_launch(dtype, kw), self.args(**kw))

    def prepare_outputs(
        self, call: KernelCall, inputs: Tensors, outputs: Tensors, weights: Tensors, ctx: LaunchContext
    ) -> PreparedCall:
        """The launch of ``call`` writing ``outputs`` (in ``call.outputs`` order): what the runtime
        calls. A one-output kernel's :meth:`prepare_inputs`; a spec with more outputs overrides it."""
        if len(outputs) != 1:
            raise InputError(f"{self.op} ({call.nodes}) writes one output; the call names {len(outputs)}")
        return self.prepare_inputs(call, inputs, outputs[0], weights, ctx)

    def pack_weights(self, call: KernelCall, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The call's weights as the kernel reads them, by weight name (none by default)."""
        return {}

    def run_reference(
        self, call: KernelCall, inputs: Sequence[np.ndarray], weights: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        """The call's output by the numpy reference, from the plan's (ONNX-layout) weights: the
        first input, the packed weights in the call's order and :meth:`call_attrs`."""
        packed = self.pack_weights(call, weights)
        return self.reference(inputs[0], *(packed[name] for name in call.weights), **self.call_attrs(call))

    def call_attrs(self, call: KernelCall) -> dict[str, Any]:
        """The call's attributes as the keywords of :meth:`args` and :meth:`reference` alike (the
        fused epilogue, the geometry; none by default)."""
        return {}

    def typed(self, values: Mapping[str, float]) -> list[KernelArg]:
        """Values by name -> the ABI's ordered list (:attr:`PARAMS`): 64-bit device addresses as
        ``c_void_p``, the names in :attr:`FLOATS` as ``c_float``, the rest ``c_int32``."""

        def ctype(i: int, name: str) -> Any:
            return ctypes.c_void_p if i < self.POINTERS else ctypes.c_float if name in self.FLOATS else ctypes.c_int32

        return [
            (float(values[n]) if n in self.FLOATS else int(values[n]), ctype(i, n)) for i, n in enumerate(self.PARAMS)
        ]
