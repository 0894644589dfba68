"""Track B's launch plan read out of the compiler's output: what a compiled IREE CUDA module launches.

All of a static-shape module's launches are in the compiler's own output: the HAL-stage MLIR
(``iree-compile --dump-compilation-phases-to``, ``*.hal.mlir``) records the commands and the buffer
plan, and the ``.vmfb``'s CUDA executables (``CDA1`` flatbuffers, read with the ``flatbuffers``
package) hold the PTX and each kernel's block size and dynamic shared memory. :func:`extract` turns
the two into the contract's :class:`~dualtrack.contract.launch_plan.LaunchPlan`.

Replay or refuse, never guess: anything outside the small, static subset below (control flow or
computed values in the entry function or the command buffer, queue operations other than the
memoized command buffer, initialisers that compute buffers, unknown ops or forms) raises
:class:`NotReplayable` with the reason, and the segment keeps the IREE runtime path. The build
records the reason; ``dualtrack info`` shows it.

The MLIR is read as text with regular expressions: the HAL dialect's printed form is stable within
an IREE release (CACHE_FORMAT in track_b.py moves with the compiler version), the subset is small,
and MLIR's own Python bindings for IREE's dialects ship with the compiler wheel only and do not
parse the ``hal``/``util``/``io_parameters`` ops without IREE's registered dialects.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dualtrack.contract.launch_plan import (
    Command,
    Copy,
    Dispatch,
    Fill,
    LaunchPlan,
    NotReplayable,
    Param,
    Ref,
    Result,
    TensorArg,
    check,
)

# ---------------------------------------------------------------------------------------------
# The CUDA executables of a .vmfb (CDA1 flatbuffers)


@dataclass(frozen=True)
class Export:
    module: int  # index into the executable's PTX modules
    name: str
    block: tuple[int, int, int]
    shared_bytes: int
    constants: int
    bindings: int


@dataclass(frozen=True)
class Executable:
    exports: dict[str, Export]
    ptx: tuple[bytes, ...]


_FILE_HEADER = 64  # IREE's flatbuffer file header before the CDA1 flatbuffer


def read_executables(vmfb: bytes) -> dict[str, Executable]:
    """The CUDA executables of a ``.vmfb`` (a zip of uncompressed entries), by entry name
    (``<executable>_<variant>.fb``, IREE's sanitised symbols).

    Schema (iree-org/iree ``runtime/src/iree/schemas/cuda_executable_def.fbs``): ``ExecutableDef
    {exports: [ExportDef], modules: [ModuleDef]}``, ``ExportDef {module_ordinal, kernel_name,
    block_dims {x, y, z}, block_shared_memory_size, constant_count, binding_flags: [u64], ...}``,
    ``ModuleDef {ptx_image}``.
    """
    from flatbuffers import encode, table
    from flatbuffers import number_types as nt

    out: dict[str, Executable] = {}
    with zipfile.ZipFile(io.BytesIO(vmfb)) as z:
        for info in z.infolist():
            data = z.read(info)
            if not info.filename.endswith(".fb") or data[4 + _FILE_HEADER : 8 + _FILE_HEADER] != b"CDA1":
                continue
            buf = bytearray(data[_FILE_HEADER:])
            root = table.Table(buf, encode.Get(nt.UOffsetTFlags.packer_type, buf, 0))

            def field(t: Any, slot: int) -> int:
                return t.Offset(4 + 2 * slot)

            def u32(t: Any, slot: int) -> int:
                o = field(t, slot)
                return t.Get(nt.Uint32Flags, t.Pos + o) if o else 0

            def tables(t: Any, slot: int) -> list[Any]:
                o = field(t, slot)
                if not o:
                    return []
                start = t.Vector(o)
                return [table.Table(t.Bytes, t.Indirect(start + 4 * i)) for i in range(t.VectorLen(o))]

            exports: dict[str, Export] = {}
            for e in tables(root, 0):
                o = field(e, 2)
                block = tuple(e.Get(nt.Uint32Flags, e.Pos + o + 4 * i) for i in range(3)) if o else (1, 1, 1)
                fo = field(e, 5)
                name = e.String(e.Pos + field(e, 1)).decode()
                exports[name] = Export(u32(e, 0), name, block, u32(e, 3), u32(e, 4), e.VectorLen(fo) if fo else 0)  # type: ignore[arg-type]
            modules = tuple(m.String(m.Pos + field(m, 0)) for m in tables(root, 1))
            out[info.filename] = Executable(exports, modules)
    return out


def sanitize(symbol: str) -> str:
    """IREE's file and kernel name for a symbol: every character other than [A-Za-z0-9_] becomes '_'."""
    return re.sub(r"[^A-Za-z0-9_]", "_", symbol)


# ---------------------------------------------------------------------------------------------
# The HAL-stage MLIR


_TOP = re.compile(
    r"^  (util\.func (?:public|private) @(\S+?)\(([^)]*)\)|util\.initializer) .*\{$|^  util\.initializer \{$"
)
_GLOBAL = re.compile(r"^  util\.global private (?:mutable )?@(\S+)(?: \{[^}]*\})? (?::|=) ?(.*)$")
_ALIAS = re.compile(r"^(#\w+) = (.*)")
_CONST = re.compile(r"^(%[-\w$.]+) = arith\.constant (-?\d+|true|false)(?: : \w+)?$")
_NAME = re.compile(r"^(?:%[-\w$.#:]+(?:, %[-\w$.#:]+)* = )?([a-z_]+(?:\.[a-z_]+)+)")
_REF = r"\((%[-\w$.#]+) : (index|!hal\.buffer)\)"
_BINDING = re.compile(_REF + r"\[(%[-\w$.]+), (%[-\w$.]+)\]")
_DTYPES = {
    "f16": "float16", "f32": "float32", "f64": "float64", "bf16": "bfloat16", "i8": "int8", "i16": "int16",
    "i32": "int32", "i64": "int64", "i1": "bool", "ui8": "uint8", "si8": "int8",
}  # fmt: skip
_NP = {"i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "f16": np.float16,
       "f32": np.float32, "f64": np.float64, "ui8": np.uint8}  # fmt: skip

_SETUP_TYPES = ("!hal.device", "!hal.executable", "i1")


@dataclass
class _Func:
    name: str  # "" for an initializer
    args: list[str]
    body: list[str]  # statements, one op each (multi-line ops joined)


def _statements(lines: list[str]) -> list[str]:
    """Join each op's lines: an op continues while its brackets are open."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if not cur and line.startswith("^"):
            out.append(line.split("//")[0].strip())  # a block label: control flow
            continue
        cur.append(line)
        text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
        depth += sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")
        if depth <= 0:
            out.append(" ".join(cur))
            cur, depth = [], 0
    if cur:
        out.append(" ".join(cur))
    return out


def _split(text: str) -> tuple[list[_Func], dict[str, str], dict[str, str]]:
    """Functions and initialisers, global types, and ``#alias`` definitions of a HAL-stage module."""
    lines = text.splitlines()
    funcs: list[_Func] = []
    globals_: dict[str, str] = {}
    aliases: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            m = _ALIAS.match(line)
            j = i
            while m and line.count("[") > line.count("]") and j + 1 < len(lines):
                j += 1  # a multi-line alias (#util.composite<..., [ ... ]>)
                line += "\n" + lines[j]
            if m:
                aliases[m.group(1)] = line.split(" = ", 1)[1]
            i = j + 1
            continue
        g = _GLOBAL.match(line)
        if g:
            globals_[g.group(1)] = g.group(2)
        m = _TOP.match(line)
        if m:
            j = i + 1
            while j < len(lines) and lines[j] != "  }":
                j += 1
            name = m.group(2) or ""
            args = [a.split(":")[0].strip() for a in (m.group(3) or "").split(",") if a.strip()]
            types = [a.split(":", 1)[1].strip() for a in (m.group(3) or "").split(",") if ":" in a]
            funcs.append(
                _Func(name, [f"{a}|{t}" for a, t in zip(args, types, strict=True)], _statements(lines[i + 1 : j]))
            )
            i = j + 1
            continue
        i += 1
    return funcs, globals_, aliases


def _op(stmt: str) -> str:
    if stmt.startswith("^"):
        return "^block"
    m = _NAME.match(stmt)
    return m.group(1) if m else stmt.split(" ")[0]


def _result(stmt: str) -> str | None:
    m = re.match(r"^(%[-\w$.]+)(?::\d+)? = ", stmt)
    return m.group(1) if m else None


class _Values:
    """SSA integer constants of one function."""

    def __init__(self, body: list[str]) -> None:
        self.ints: dict[str, int] = {}
        for s in body:
            m = _CONST.match(s)
            if m:
                v = m.group(2)
                self.ints[m.group(1)] = {"true": 1, "false": 0}.get(v, 0) if v in ("true", "false") else int(v)

    def int(self, name: str, what: str) -> int:
        if name not in self.ints:
            raise NotReplayable(f"{what} is the run-time value {name}, not a constant")
        return self.ints[name]


def _composite_bytes(value: str, aliases: Mapping[str, str]) -> bytes:
    """The bytes of a ``util.buffer.constant`` value: a ``#util.composite`` or a ``dense`` attribute."""
    value = value.strip()
    if value.startswith("#"):
        if value not in aliases:
            raise NotReplayable(f"constant {value} is not defined in the module")
        value = aliases[value].strip()
    m = re.match(r"#util\.composite<(\d+)xi8, \[(.*)\]>$", value, re.S)
    if m:
        parts = [p.strip() for p in re.split(r",\s*\n", m.group(2).strip().rstrip(",")) if p.strip()]
        data = b"".join(_dense_bytes(p) for p in parts)
        if len(data) != int(m.group(1)):
            raise NotReplayable(f"a composite constant of {m.group(1)} bytes decoded to {len(data)}")
        return data
    return _dense_bytes(value)


def _dense_bytes(entry: str) -> bytes:
    m = re.match(r"^dense<(.*)> : (?:tensor|vector)<((?:\d+x)*)(\w+)>$", entry.strip(), re.S)
    if not m or m.group(3) not in _NP:
        raise NotReplayable(f"constant form not understood: {entry[:80]}")
    count = int(np.prod([int(d) for d in m.group(2).split("x") if d], dtype=np.int64)) if m.group(2) else 1
    dtype = np.dtype(_NP[m.group(3)])
    raw = m.group(1).strip()
    if raw.startswith('"0x'):
        data = bytes.fromhex(raw[3:-1])
        if len(data) == dtype.itemsize * count:
            return data
        if len(data) == dtype.itemsize:
            return data * count  # a splat
        raise NotReplayable(f"a hex constant of {len(data)} bytes for {count} x {m.group(3)}")
    if raw.startswith("["):
        values = [float(v) if m.group(3).startswith("f") else int(v) for v in re.findall(r"[-+\w.]+", raw)]
        if len(values) != count:
            raise NotReplayable(f"a constant list of {len(values)} values for {count}")
        return np.asarray(values, dtype).tobytes()
    if raw in ("true", "false"):
        raw = "1" if raw == "true" else "0"
    try:
        scalar = float(raw) if m.group(3).startswith("f") else int(raw)
    except ValueError:
        raise NotReplayable(f"constant form not understood: {entry[:80]}") from None
    return np.full(count, scalar, dtype).tobytes()


_GLOBAL_NAME = r'@("[^"]+"|[^\s:,]+)'
_SKIP = frozenset(
    (
        "arith.constant", "hal.memory_type", "hal.buffer_usage", "hal.element_type", "hal.encoding_type",
        "util.null", "hal.device.allocator", "hal.fence.create", "hal.fence.join", "hal.fence.await",
        "util.status.check_ok", "hal.device.queue.dealloca", "util.return", "hal.buffer.assert",
        "hal.buffer_view.assert", "hal.buffer_view.buffer", "hal.buffer_view.create",
    )
)  # fmt: skip
_RECORDING = frozenset(
    (
        "hal.command_buffer.create", "hal.executable.lookup.function", "hal.command_buffer.dispatch",
        "hal.command_buffer.execution_barrier", "hal.command_buffer.fill_buffer", "hal.command_buffer.copy_buffer",
        "hal.command_buffer.finalize",
    )
)  # fmt: skip


def _unquote(name: str) -> str:
    return name[1:-1] if name.startswith('"') else name


@dataclass
class _Scope:
    """The state of one function body while :meth:`_Builder.run` reads it."""

    vals: _Values
    env: dict[str, Ref]  # SSA buffer value -> the range it names
    entry: bool
    sink: list[Command]  # where its commands go: per call (entry) or once at load
    strings: dict[str, str] = field(default_factory=dict)  # string constants (parameter scopes, keys)
    memo: dict[str, str] = field(default_factory=dict)  # loaded command buffer value -> its global
    inline: list[str] = field(default_factory=list)  # recording ops not yet executed


class _Builder:
    """Reads the module's functions in order, resolving every buffer a command names to a :class:`Ref`:
    initialisers first (parameters, constants, buffers they compute once: ``init`` commands), then
    the entry function (``commands``, over the input, transient slabs and those globals)."""

    def __init__(self, funcs: dict[str, _Func], exes: Mapping[str, Executable], aliases: Mapping[str, str]) -> None:
        self.funcs, self.exes, self.aliases = funcs, exes, aliases
        self.params: list[Param] = []
        self.constants: list[bytes] = []
        self.globals: list[int] = []  # buffers an initialiser allocates and fills once
        self.slabs: list[int] = []
        self.global_refs: dict[str, Ref] = {}
        self.memoized: dict[str, str] = {}  # command buffer global -> the function that records it
        self.modules: list[bytes] = []
        self.init: list[Command] = []
        self.commands: list[Command] = []

    def module(self, ptx: bytes) -> int:
        if ptx not in self.modules:
            self.modules.append(ptx)
        return self.modules.index(ptx)

    # -- initialisers ------------------------------------------------------------------------------

    def initializer(self, f: _Func) -> None:
        stores = [re.match(r"util\.global\.store (%[-\w$.#]+), " + _GLOBAL_NAME + r" : (.*)$", s) for s in f.body]
        stored = [(m.group(1), _unquote(m.group(2)), m.group(3).strip()) for m in stores if m]
        if not stored or all(t.startswith(_SETUP_TYPES) for _, _, t in stored):
            return  # device, executables, format queries: IREE's setup, nothing to carry
        ops = {_op(s) for s in f.body}
        for _value, name, typ in stored:
            if typ == "!hal.command_buffer":
                calls = [m.group(1) for m in (re.search(r"util\.call @(\S+?)\(", s) for s in f.body) if m]
                if len(calls) != 1:
                    raise NotReplayable(f"command buffer @{name} is not recorded by one memoized function")
                self.memoized[name] = calls[0]
        if any(t == "!hal.command_buffer" for _, _, t in stored):
            return
        bad = [t for _, _, t in stored if t != "!hal.buffer"]
        if bad:
            raise NotReplayable(f"an initialiser stores {bad[0]} state the replay cannot hold")
        consts = [
            c.group(1)
            for c in (re.search(r"util\.buffer\.constant(?: <[^>]*>)? : !util\.buffer = ([^\"].*)$", s) for s in f.body)
            if c
        ]
        if consts:
            # IREE's hoisted constant: imported from the module's rodata or read into a new buffer,
            # on two branches (control flow this reader knows); the data is what matters.
            if len(consts) != 1 or len(stored) != 1 or ops & {"hal.command_buffer.dispatch", "io_parameters.load"}:
                raise NotReplayable(f"initialiser of @{stored[0][1]} does more than load one constant")
            data = _composite_bytes(consts[0], self.aliases)
            self.constants.append(data)
            self.global_refs[stored[0][1]] = Ref("const", len(self.constants) - 1, 0, len(data))
            return
        env = self.run(f.body, entry=False)
        for value, name, _ in stored:
            if value not in env:
                raise NotReplayable(f"@{name} is stored from {value}, which this reader cannot follow")
            self.global_refs[name] = env[value]

    # -- a function body ---------------------------------------------------------------------------

    def run(self, body: list[str], *, entry: bool, env: dict[str, Ref] | None = None) -> dict[str, Ref]:
        """Interpret one body; returns its buffer environment. ``entry``: the exported function
        (transient buffers are slabs, commands run per call) or an initialiser (they are globals and
        ``init`` commands, run once at load)."""
        scope = _Scope(_Values(body), dict(env or {}), entry, self.commands if entry else self.init)
        # One handler per op that names or moves a buffer; recording ops wait for their queue op.
        handlers: dict[str, Callable[[str, _Scope], None]] = {
            "util.buffer.constant": self._string_constant,
            "io_parameters.load": self._load_parameters,
            "hal.device.queue.alloca": self._allocate,
            "util.global.load": self._load_global,
            "hal.device.queue.execute.indirect": self._execute_memoized,
            "hal.device.queue.execute": self._execute_inline,
        }
        for s in body:
            op = _op(s)
            if op in _RECORDING:
                scope.inline.append(s)
            elif op in handlers:
                handlers[op](s, scope)
            elif op == "util.global.store" and not entry:
                continue  # the caller maps stores to globals
            elif op not in _SKIP:
                raise NotReplayable(
                    f"the {'entry function' if entry else 'initialiser'} holds {op} (control flow or run-time work)"
                )
        if scope.inline:
            raise NotReplayable("a command buffer is recorded but never executed")
        return scope.env

    def _string_constant(self, s: str, scope: _Scope) -> None:
        m = re.match(r'^(%[-\w$.]+) = util\.buffer\.constant : !util\.buffer = "(.*)"$', s)
        if not m:
            raise NotReplayable(f"a constant buffer inside a function: {s[:100]}")
        scope.strings[m.group(1)] = m.group(2)

    def _load_parameters(self, s: str, scope: _Scope) -> None:
        res = _result(s)
        entries = re.findall(r"(%[-\w$.]+)::(%[-\w$.]+)\[(%[-\w$.]+)\] : !hal\.buffer\{(%[-\w$.]+)\}", s)
        count = re.match(r"^%[-\w$.]+:(\d+) = ", s)
        if res is None or not entries or (count and int(count.group(1)) != len(entries)):
            raise NotReplayable(f"parameter load not understood: {s[:120]}")
        for i, (scope_name, key, off, n) in enumerate(entries):
            if scope_name not in scope.strings or key not in scope.strings:
                raise NotReplayable("a parameter's scope or key is not a constant string")
            p = Param(
                scope.strings[scope_name],
                scope.strings[key],
                scope.vals.int(off, "a parameter offset"),
                scope.vals.int(n, "a parameter length"),
            )
            self.params.append(p)
            scope.env[f"{res}#{i}" if count else res] = Ref("param", len(self.params) - 1, 0, p.length)

    def _allocate(self, s: str, scope: _Scope) -> None:
        res = _result(s)
        m = re.search(r"!hal\.buffer\{(%[-\w$.]+)\}$", s)
        if not m or res is None:
            raise NotReplayable(f"transient allocation not understood: {s[:120]}")
        size = scope.vals.int(m.group(1), "a transient buffer size")
        sizes, kind = (self.slabs, "slab") if scope.entry else (self.globals, "glob")
        sizes.append(size)
        scope.env[res] = Ref(kind, len(sizes) - 1, 0, size)  # type: ignore[arg-type]

    def _load_global(self, s: str, scope: _Scope) -> None:
        res = _result(s)
        m = re.match(r"^%[-\w$.]+ = util\.global\.load (?:immutable )?" + _GLOBAL_NAME + r" : (.*)$", s)
        if not m or res is None:
            raise NotReplayable(f"global load not understood: {s[:120]}")
        name, typ = _unquote(m.group(1)), m.group(2)
        if typ == "!hal.buffer":
            if name not in self.global_refs:
                raise NotReplayable(f"buffer @{name} is not one an initialiser loads or computes")
            scope.env[res] = self.global_refs[name]
        elif typ == "!hal.command_buffer":
            if name not in self.memoized:
                raise NotReplayable(f"command buffer @{name} is not memoized at initialisation")
            scope.memo[res] = name
        elif not typ.startswith(_SETUP_TYPES):
            raise NotReplayable(f"the module reads global state @{name} ({typ})")

    def _execute_memoized(self, s: str, scope: _Scope) -> None:
        """A memoized command buffer run over the queue's binding table (its slots)."""
        m = re.search(r"commands\((%[-\w$.]+)\) bindings\(\[(.*)\]\) flags\(\"None\"\)$", s)
        if not m or m.group(1) not in scope.memo:
            raise NotReplayable(f"queue execution not understood: {s[:120]}")
        slots = []
        for v, t, o, n in _BINDING.findall(m.group(2)):
            if t != "!hal.buffer" or v not in scope.env:
                raise NotReplayable(f"binding table entry {v} is not a buffer the plan knows")
            base = scope.env[v]
            off, size = scope.vals.int(o, "a binding table offset"), scope.vals.int(n, "a binding table length")
            if off + size > base.length:
                raise NotReplayable(f"binding table entry {v} [{off}, +{size}) runs past its buffer")
            slots.append(Ref(base.kind, base.index, base.offset + off, size))
        function = self.memoized[scope.memo[m.group(1)]]
        fn = self.funcs.get(function)
        if fn is None:
            raise NotReplayable(f"memoized command buffer function @{function} not found")
        self.record(fn.body, slots, {}, scope.sink)

    def _execute_inline(self, s: str, scope: _Scope) -> None:
        """The command buffer recorded inline since the last execution, over the body's buffers."""
        if not re.search(r"commands\((%[-\w$.]+)\) flags\(\"None\"\)$", s) or not scope.inline:
            raise NotReplayable(f"queue execution not understood: {s[:120]}")
        self.record(scope.inline, None, scope.env, scope.sink, scope.vals)
        scope.inline = []

    def record(
        self,
        body: list[str],
        slots: list[Ref] | None,
        buffers: Mapping[str, Ref],
        sink: list[Command],
        vals: _Values | None = None,
    ) -> None:
        """Append the commands of a command buffer recorded by ``body``: a memoized one's bindings
        name slots (``slots``: the queue's binding table), an inline one's name buffers directly
        (``vals``: the constants of the function that records it inline)."""
        vals = vals or _Values(body)
        env = dict(buffers)
        functions: dict[str, tuple[str, str, str]] = {}
        for s in body:
            op = _op(s)
            if op == "util.global.load" and s.endswith("!hal.buffer"):
                m = re.match(
                    r"^(%[-\w$.]+) = util\.global\.load (?:immutable )?" + _GLOBAL_NAME + r" : !hal\.buffer$", s
                )
                if not m or _unquote(m.group(2)) not in self.global_refs:
                    raise NotReplayable(f"a command buffer reads a buffer no initialiser provides: {s[:100]}")
                env[m.group(1)] = self.global_refs[_unquote(m.group(2))]
            elif op == "hal.executable.lookup.function":
                m = re.search(r"function\(@([^:]+)::@([^:]+)::@([^)]+)\)", s)
                if not m:
                    raise NotReplayable(f"executable function reference not understood: {s[:120]}")
                functions[_result(s) or ""] = (m.group(1), m.group(2), m.group(3))
            elif op == "hal.command_buffer.dispatch":
                sink.append(self.dispatch(s, vals, functions, slots, env))
            elif op == "hal.command_buffer.fill_buffer":
                m = re.search(
                    r"target"
                    + _REF
                    + r"\[(%[-\w$.]+), (%[-\w$.]+)\] pattern\((%[-\w$.]+) : i(8|16|32)\) flags\(\"None\"\)",
                    s,
                )
                if not m:
                    raise NotReplayable(f"fill_buffer form not understood: {s[:120]}")
                target = self.binding(m.group(1), m.group(2), m.group(3), m.group(4), vals, slots, env)
                width = int(m.group(6)) // 8
                pattern = vals.int(m.group(5), "a fill pattern") & ((1 << (8 * width)) - 1)
                sink.append(Fill(target, pattern, width))
            elif op == "hal.command_buffer.copy_buffer":
                m = re.search(
                    r"source" + _REF + r"\[(%[-\w$.]+)\] target" + _REF + r"\[(%[-\w$.]+)\] length\((%[-\w$.]+)\) "
                    r"flags\(\"None\"\)",
                    s,
                )
                if not m:
                    raise NotReplayable(f"copy_buffer form not understood: {s[:120]}")
                length = m.group(7)
                src = self.binding(m.group(1), m.group(2), m.group(3), length, vals, slots, env)
                dst = self.binding(m.group(4), m.group(5), m.group(6), length, vals, slots, env)
                sink.append(Copy(src, dst))
            elif op == "hal.command_buffer.execution_barrier":
                if not s.endswith('flags("None")'):
                    raise NotReplayable(f"execution barrier with flags: {s[-60:]}")
            elif op not in ("arith.constant", "util.global.load", "hal.command_buffer.create",
                            "hal.command_buffer.finalize", "util.return"):  # fmt: skip
                raise NotReplayable(f"the command buffer holds {op}")

    def binding(
        self,
        value: str,
        typ: str,
        off: str,
        length: str,
        vals: _Values,
        slots: list[Ref] | None,
        env: Mapping[str, Ref],
    ) -> Ref:
        offset, size = vals.int(off, "a binding offset"), vals.int(length, "a binding length")
        if typ == "index":
            if slots is None:
                raise NotReplayable("an inline command buffer names a binding slot")
            slot = vals.int(value, "a binding slot")
            if slot >= len(slots):
                raise NotReplayable(f"binding slot {slot} is not in the queue's binding table ({len(slots)})")
            base = slots[slot]
        elif value in env:
            base = env[value]
        else:
            raise NotReplayable(f"buffer {value} of a command is not one the plan knows")
        if offset + size > base.length:
            raise NotReplayable(f"a binding [{offset}, +{size}) runs past its buffer ({base.length} B)")
        return Ref(base.kind, base.index, base.offset + offset, size)

    def dispatch(
        self,
        s: str,
        vals: _Values,
        functions: Mapping[str, tuple[str, str, str]],
        slots: list[Ref] | None,
        env: Mapping[str, Ref],
    ) -> Dispatch:
        m = re.search(r"\)\[(%[-\w$.]+)\] workgroups\(\[(%[-\w$.]+), (%[-\w$.]+), (%[-\w$.]+)\]\)", s)
        if not m or m.group(1) not in functions:
            raise NotReplayable(f"dispatch form not understood: {s[:120]}")
        if not s.endswith('flags("None")'):
            raise NotReplayable(f"dispatch with flags: {s[-60:]}")
        grid = tuple(vals.int(v, "a dispatch's workgroup count") for v in m.groups()[1:])
        c = re.search(r"constants\(\[([^\]]*)\]\)", s)
        consts = tuple(
            vals.int(v.strip(), "a push constant") & 0xFFFFFFFF
            for v in (c.group(1).split(",") if c else [])
            if v.strip()
        )
        b = re.search(r"bindings\(\[(.*)\]\) flags", s)
        refs = tuple(
            self.binding(v, t, o, n, vals, slots, env) for v, t, o, n in _BINDING.findall(b.group(1) if b else "")
        )
        exe_sym, variant, fn = functions[m.group(1)]
        entry = f"{sanitize(exe_sym)}_{sanitize(variant)}.fb"
        exe = self.exes.get(entry)
        export = exe.exports.get(sanitize(fn)) if exe else None
        if exe is None or export is None:
            raise NotReplayable(f"kernel {fn} is not in the module's CUDA executables ({entry})")
        if export.bindings != len(refs) or export.constants != len(consts):
            raise NotReplayable(
                f"kernel {fn} takes {export.bindings} bindings and {export.constants} constants; "
                f"the dispatch passes {len(refs)} and {len(consts)}"
            )
        return Dispatch(
            self.module(exe.ptx[export.module]),
            export.name,
            grid,
            export.block,
            export.shared_bytes,
            refs,
            consts,  # type: ignore[arg-type]
        )


@dataclass
class _Inputs:
    """The entry function's inputs: each one's asserted shape and element type, and its buffer."""

    arg_index: dict[str, int]  # buffer view argument -> input index
    element: dict[str, str]  # SSA element type value -> IREE element type
    asserts: dict[int, tuple[tuple[int, ...], str]]  # input index -> (shape, IREE element type)
    env: dict[str, Ref]  # SSA buffer of an input -> its whole range

    def args(self) -> tuple[TensorArg, ...]:
        out = []
        for i in range(len(self.arg_index)):
            shape, et = self.asserts[i]
            out.append(TensorArg(shape, _DTYPES[et], _nbytes(shape, et)))
        return tuple(out)


def _nbytes(shape: tuple[int, ...], et: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[et]).itemsize


def _entry(funcs: list[_Func]) -> _Func:
    """The exported coarse-fences function: the one call the runtime makes."""
    entries = [f for f in funcs if f.name.endswith("$async") and any(a.endswith("!hal.fence") for a in f.args)]
    if len(entries) != 1:
        raise NotReplayable(f"expected one exported coarse-fences function, found {len(entries)}")
    return entries[0]


def _read_inputs(entry: _Func, vals: _Values) -> _Inputs:
    """Each input's shape from its assertion, and the buffer the entry function reads it through."""
    args = (a for a in entry.args if a.endswith("!hal.buffer_view"))
    inputs = _Inputs({a.split("|")[0]: i for i, a in enumerate(args)}, {}, {}, {})
    for s in entry.body:
        op, res = _op(s), _result(s)
        if op == "hal.element_type":
            m = re.search(r"hal\.element_type<(\w+)>", s)
            if m and res:
                inputs.element[res] = m.group(1)
        elif op == "hal.buffer_view.assert":
            m = re.search(
                r"<(%[-\w$.]+) : !hal\.buffer_view> message\(\"[^\"]*\"\) shape\(\[([^\]]*)\]\) type\((%[-\w$.]+)\)", s
            )
            if not m or m.group(1) not in inputs.arg_index:
                raise NotReplayable(f"input assertion not understood: {s[:120]}")
            shape = tuple(vals.int(d.strip(), "an input dimension") for d in m.group(2).split(",") if d.strip())
            inputs.asserts[inputs.arg_index[m.group(1)]] = (shape, inputs.element.get(m.group(3), "?"))
        elif op == "hal.buffer_view.buffer":
            m = re.search(r"<(%[-\w$.]+) : !hal\.buffer_view>", s)
            if not m or m.group(1) not in inputs.arg_index or res is None:
                raise NotReplayable(f"input buffer not understood: {s[:120]}")
            i = inputs.arg_index[m.group(1)]
            if i not in inputs.asserts:
                raise NotReplayable(f"input {i} is read before its shape is asserted")
            shape, et = inputs.asserts[i]
            if et not in _DTYPES:
                raise NotReplayable(f"input element type {et} not understood")
            inputs.env[res] = Ref("input", i, 0, _nbytes(shape, et))
    if len(inputs.asserts) != len(inputs.arg_index):
        raise NotReplayable("an input has no shape assertion")
    return inputs


def _read_results(
    entry: _Func, vals: _Values, element: Mapping[str, str], env: Mapping[str, Ref]
) -> tuple[Result, ...]:
    """The views the entry function returns, each a range of a buffer the plan knows."""
    results: dict[str, Result] = {}
    returned: list[str] = []
    for s in entry.body:
        op, res = _op(s), _result(s)
        if op == "hal.buffer_view.create":
            m = re.search(
                r"buffer\((%[-\w$.]+) : !hal\.buffer\)\[(%[-\w$.]+), (%[-\w$.]+)\] "
                r"shape\(\[([^\]]*)\]\) type\((%[-\w$.]+)\)",
                s,
            )
            if not m or m.group(1) not in env or res is None:
                raise NotReplayable(f"result view not understood: {s[:120]}")
            base = env[m.group(1)]
            off, size = vals.int(m.group(2), "a result offset"), vals.int(m.group(3), "a result length")
            shape = tuple(vals.int(d.strip(), "a result dimension") for d in m.group(4).split(",") if d.strip())
            et = element.get(m.group(5), "")
            if et not in _DTYPES:
                raise NotReplayable(f"result element type {et or m.group(5)} not understood")
            results[res] = Result(Ref(base.kind, base.index, base.offset + off, size), shape, _DTYPES[et])
        elif op == "util.return":
            returned = [v.strip() for v in s.removeprefix("util.return").split(":")[0].split(",") if v.strip()]
    if not returned or any(v not in results for v in returned):
        raise NotReplayable("a result is not a view of a known buffer")
    return tuple(results[v] for v in returned)


def extract(hal_mlir: str, vmfb: bytes) -> tuple[LaunchPlan, tuple[bytes, ...]]:
    """The launch plan of a static-shape module and its PTX modules, or :class:`NotReplayable`."""
    funcs, _types, aliases = _split(hal_mlir)
    entry = _entry(funcs)
    exes = read_executables(vmfb)
    if not exes:
        raise NotReplayable("the module has no CUDA executable")
    b = _Builder({f.name: f for f in funcs if f.name}, exes, aliases)
    # Initialisers first: the entry function's commands name the buffers they load or compute.
    for f in funcs:
        if not f.name:
            b.initializer(f)
    vals = _Values(entry.body)
    inputs = _read_inputs(entry, vals)
    env = b.run(entry.body, entry=True, env=inputs.env)
    plan = LaunchPlan(
        inputs=inputs.args(),
        slabs=tuple(b.slabs),
        params=tuple(b.params),
        constants=tuple(b.constants),
        commands=tuple(b.commands),
        results=_read_results(entry, vals, inputs.element, env),
        modules=len(b.modules),
        globals=tuple(b.globals),
        init=tuple(b.init),
    )
    check(plan)
    return plan, tuple(b.modules)
