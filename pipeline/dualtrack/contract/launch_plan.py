"""Track B's launch plan: a compiled IREE CUDA module as a fixed list of kernel launches.

A static-shape IREE module runs the same command buffer on every call: the same kernels, grids,
push constants and buffer offsets, over an input, a few transient slabs, the weights (parameters)
and constants hoisted at initialisation (FACTS 23). A :class:`LaunchPlan` holds all of it; the
runtime (runtime/replay.py) launches it on its own stream, inside its own CUDA graph, with no IREE
runtime call. This module is the contract only: the plan's dataclasses, their JSON form and the
bounds :func:`check` proves. The compiler reads plans out of IREE's output
(:mod:`dualtrack.compiler.launch_extract`); anything it cannot read raises :class:`NotReplayable`, and
the segment keeps the IREE runtime path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

LAUNCH_PLAN_VERSION = 1
# IREE assumes every binding it hands a kernel is this aligned (its HAL's buffer alignment).
BINDING_ALIGNMENT = 64

RefKind = Literal["input", "slab", "param", "const", "glob"]


class NotReplayable(Exception):
    """The module is not a static list of launches this reader understands; the message says why."""


@dataclass(frozen=True)
class Ref:
    """A byte range of one buffer: segment input ``index``, transient slab (per call), parameter,
    constant, or a global that an initialiser computes once (``glob``)."""

    kind: RefKind
    index: int
    offset: int
    length: int


@dataclass(frozen=True)
class Dispatch:
    """One kernel launch: ``kernel`` of PTX ``module``; one pointer argument per binding, then one
    32-bit argument per push constant (IREE's CUDA kernel ABI)."""

    module: int
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    bindings: tuple[Ref, ...]
    constants: tuple[int, ...] = ()
    op: Literal["dispatch"] = "dispatch"


@dataclass(frozen=True)
class Fill:
    """``target`` filled with ``pattern``, a little-endian value of ``width`` bytes."""

    target: Ref
    pattern: int
    width: int
    op: Literal["fill"] = "fill"


@dataclass(frozen=True)
class Copy:
    source: Ref
    target: Ref
    op: Literal["copy"] = "copy"


Command = Dispatch | Fill | Copy


@dataclass(frozen=True)
class Param:
    """Bytes ``offset``..``offset+length`` of parameter ``key`` in ``scope`` (the ONNX initializer
    whose :func:`dualtrack.contract.plan.parameter_key` is ``key``), uploaded once."""

    scope: str
    key: str
    offset: int
    length: int


@dataclass(frozen=True)
class Result:
    """A module result: a range of ``source`` seen as ``shape`` of ``dtype`` (IREE's element type)."""

    source: Ref
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TensorArg:
    shape: tuple[int, ...]
    dtype: str
    min_bytes: int


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the runtime needs to run one (segment, IREE target, batch) without IREE."""

    inputs: tuple[TensorArg, ...]
    slabs: tuple[int, ...]  # transient buffer sizes in bytes
    params: tuple[Param, ...]
    constants: tuple[bytes, ...]  # hoisted constants, uploaded once
    commands: tuple[Command, ...]
    results: tuple[Result, ...]
    modules: int  # how many PTX modules (stored beside the plan)
    globals: tuple[int, ...] = ()  # buffers the initialisers compute once (sizes in bytes)
    init: tuple[Command, ...] = ()  # run once at load, before any call: what the initialisers do
    version: int = LAUNCH_PLAN_VERSION

    @property
    def dispatches(self) -> tuple[Dispatch, ...]:
        return tuple(c for c in self.commands if isinstance(c, Dispatch))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["constants"] = [c.hex() for c in self.constants]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LaunchPlan:
        if d.get("version") != LAUNCH_PLAN_VERSION:
            raise ValueError(f"launch plan version {d.get('version')}, this dualtrack reads {LAUNCH_PLAN_VERSION}")

        def ref(r: Mapping[str, Any]) -> Ref:
            return Ref(r["kind"], r["index"], r["offset"], r["length"])

        def command(c: Mapping[str, Any]) -> Command:
            if c["op"] == "dispatch":
                return Dispatch(
                    c["module"], c["kernel"], tuple(c["grid"]), tuple(c["block"]), c["shared_bytes"],
                    tuple(ref(b) for b in c["bindings"]), tuple(c["constants"]),
                )  # fmt: skip
            if c["op"] == "fill":
                return Fill(ref(c["target"]), c["pattern"], c["width"])
            if c["op"] == "copy":
                return Copy(ref(c["source"]), ref(c["target"]))
            raise ValueError(f"unknown launch plan command {c['op']!r}")

        return cls(
            inputs=tuple(TensorArg(tuple(t["shape"]), t["dtype"], t["min_bytes"]) for t in d["inputs"]),
            slabs=tuple(d["slabs"]),
            params=tuple(Param(**p) for p in d["params"]),
            constants=tuple(bytes.fromhex(c) for c in d["constants"]),
            commands=tuple(command(c) for c in d["commands"]),
            results=tuple(Result(ref(r["source"]), tuple(r["shape"]), r["dtype"]) for r in d["results"]),
            modules=d["modules"],
            globals=tuple(d.get("globals", ())),
            init=tuple(command(c) for c in d.get("init", ())),
        )


def refs(plan: LaunchPlan) -> Iterator[Ref]:
    """Every buffer range the plan's commands and results name."""
    for c in (*plan.init, *plan.commands):
        if isinstance(c, Dispatch):
            yield from c.bindings
        elif isinstance(c, Fill):
            yield c.target
        else:
            yield c.source
            yield c.target
    for r in plan.results:
        yield r.source


def check(plan: LaunchPlan) -> None:
    """Every range inside its buffer and aligned as IREE assumes; raises :class:`NotReplayable`."""
    sizes: dict[str, list[int]] = {
        "input": [t.min_bytes for t in plan.inputs],
        "slab": list(plan.slabs),
        "param": [p.length for p in plan.params],
        "const": [len(c) for c in plan.constants],
        "glob": list(plan.globals),
    }
    for r in refs(plan):
        if r.index >= len(sizes[r.kind]):
            raise NotReplayable(f"{r.kind} {r.index} does not exist")
        if r.offset < 0 or r.length < 0 or r.offset + r.length > sizes[r.kind][r.index]:
            raise NotReplayable(f"{r.kind} {r.index}: [{r.offset}, +{r.length}) runs past {sizes[r.kind][r.index]} B")
    for c in (*plan.init, *plan.commands):
        if isinstance(c, Dispatch) and any(b.offset % 16 for b in c.bindings):
            raise NotReplayable(f"kernel {c.kernel}: a binding offset is not 16-byte aligned")
    for c in plan.init:
        touched = (
            c.bindings if isinstance(c, Dispatch) else (c.target,) if isinstance(c, Fill) else (c.source, c.target)
        )
        if any(r.kind in ("input", "slab") for r in touched):
            raise NotReplayable("an initialiser command touches a per-call buffer")
    for r in plan.results:
        n = int(np.prod(r.shape, dtype=np.int64)) * np.dtype(r.dtype).itemsize
        if n != r.source.length:
            raise NotReplayable(f"a result of shape {r.shape} {r.dtype} spans {r.source.length} B, not {n}")
