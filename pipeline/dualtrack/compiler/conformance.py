"""Conformance: ONNX's own test models through the whole build, against the outputs ONNX ships with them.

Cases come from the installed ``onnx`` package: the model tests under ``onnx/backend/test/data/``
(``pytorch-converted``, ``pytorch-operator``, ``simple``: ``model.onnx`` and ``test_data_set_0``), and
the node tests of the ops a segmentation model uses (:data:`NODE_OPS`), which the wheel ships as the
generator ``onnx.backend.test.case.node`` rather than as files: they are generated in memory.

Each case goes through what a user's model goes through, with the CPU target:

1. onnxruntime runs the model as shipped on the shipped inputs. Where it cannot, or its outputs differ
   from the shipped ones, the case is ``ort`` (listed, not counted): a build is verified against
   onnxruntime, so there is nothing to hold it to.
2. dualtrack serves single-input models, so inputs after the first become constants holding their
   shipped values (a Conv node test's ``W`` becomes its weight); the table says how many.
3. ``build`` with a config that says no more than a user's would: the model, ``targets: []`` (IREE
   llvm-cpu), ``batch_sizes`` the shipped input's dim 0, a fixed verification seed; the default
   partition, no pre/post-processing (the plain path: the bundle takes and returns the model's own
   tensors); the precision is the model's own. Where the build is refused with a line that names one of
   :data:`FIXES` as the fix, the case is built again with that line added, as the user reading it would:
   ``batch: fixed`` where dim 0 holds data rather than images (a reduction, softmax, split or concat over
   axis 0, an operand with rows of its own: the exported shape is built and run whole), ``precision: fp32``
   for a float64 export (its input converted to float32 as the engine asks). Only then: a graph the image
   path takes is always built and judged as images, and the table says which cases needed which line.
4. The CPU engine runs the shipped input; every output is compared with the shipped one at the
   precision's default tolerance (non-finite values must sit where the shipped ones do).

Outcomes: ``match``, ``mismatch`` (built, outside the tolerance), ``refused`` (a dualtrack error: one
line naming the op, opset or feature and the fix), ``invalid`` (the front end wrote a model the ONNX
checker rejects: a bug), ``internal`` (another front-end failure, reported as an internal error naming where: a
bug), ``traceback`` (any other exception: a bug), ``timeout``, ``ort``.

``python -m dualtrack.compiler.conformance`` (``make conformance``) runs every case and writes
``docs/conformance.md``; tests/test_conformance.py runs a fixed subset.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnx.backend.test.case import node

from dualtrack.compiler.build import build
from dualtrack.compiler.config import FIXED_BATCH
from dualtrack.contract.checks import DEFAULT_TOLERANCES, compare
from dualtrack.errors import DualtrackError, InternalError
from dualtrack.runtime.engine import Engine

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
SUITES = ("pytorch-converted", "pytorch-operator", "simple")
NODE = "node"
# The node tests that matter for segmentation networks: convolutions, pools, norms, activations, resize,
# pad, concat, split, slice, reshape, transpose, matmul, softmax, reductions, element-wise arithmetic.
NODE_OPS = frozenset(
    [
        "Conv",
        "ConvTranspose",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "BatchNormalization",
        "InstanceNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "Relu",
        "LeakyRelu",
        "PRelu",
        "Sigmoid",
        "HardSigmoid",
        "HardSwish",
        "Tanh",
        "Elu",
        "Selu",
        "Celu",
        "Gelu",
        "Mish",
        "Softplus",
        "Softsign",
        "Clip",
        "Erf",
        "Resize",
        "Pad",
        "Concat",
        "Split",
        "Slice",
        "Reshape",
        "Transpose",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "DepthToSpace",
        "SpaceToDepth",
        "MatMul",
        "Gemm",
        "Softmax",
        "LogSoftmax",
        "ReduceMean",
        "ReduceSum",
        "ReduceMax",
        "ReduceMin",
        "ArgMax",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Sqrt",
        "Exp",
        "Log",
        "Abs",
        "Neg",
        "Reciprocal",
        "Max",
        "Min",
    ]
)
STATUSES = ("match", "mismatch", "refused", "invalid", "internal", "traceback", "timeout", "ort")
BUGS = ("invalid", "internal", "traceback")  # dualtrack's own failures, whatever onnxruntime does
# Config lines a refusal may name as its fix, which the runner then adds as a user would: a graph whose dim 0
# holds data (a reduction or concat over axis 0, an operand with rows of its own) built at its exported shape
# whole, a float64 export built in float32.
FIXES = (FIXED_BATCH, "precision: fp32")
CASE_TIMEOUT_S = 180  # IREE 3.13 compiles some graphs for ever (a wrap-mode Pad); one case must not stall the run


@dataclass(frozen=True)
class Case:
    """One test model and its shipped inputs and outputs (``model`` a path, or the model itself)."""

    suite: str
    name: str
    model: Path | onnx.ModelProto
    inputs: tuple[np.ndarray, ...]
    outputs: tuple[np.ndarray, ...]

    def load(self) -> onnx.ModelProto:
        return self.model if isinstance(self.model, onnx.ModelProto) else onnx.load(str(self.model))


@dataclass(frozen=True)
class Outcome:
    """What became of one case; ``detail`` is one line (the refusal, the worst error, the exception)."""

    suite: str
    name: str
    status: str
    detail: str = ""
    rel_l2: float | None = None
    frozen: int = 0  # inputs after the first made constants
    seconds: float = 0.0
    built: str = ""  # an `ort` case that was built anyway (onnxruntime cannot run it): the build's status
    fixes: tuple[str, ...] = ()  # the config lines of FIXES added, each after a refusal that named it

    @property
    def counted(self) -> bool:
        """Whether the case counts toward the share that builds and matches (onnxruntime ran it)."""
        return self.status != "ort"


# -- the cases ---------------------------------------------------------------------------------------


def data_cases(suite: str, names: Iterable[str] | None = None) -> list[Case]:
    """The shipped model tests of ``suite`` (all, or those named), with test_data_set_0."""
    root = DATA / suite
    chosen = sorted(names) if names is not None else sorted(p.name for p in root.iterdir() if p.is_dir())
    cases = []
    for name in chosen:
        ds = root / name / "test_data_set_0"
        ins = tuple(_tensor(p) for p in sorted(ds.glob("input_*.pb"), key=_index))
        outs = tuple(_tensor(p) for p in sorted(ds.glob("output_*.pb"), key=_index))
        cases.append(Case(suite, name, root / name / "model.onnx", ins, outs))
    return cases


def _index(p: Path) -> int:
    return int(p.stem.rsplit("_", 1)[1])


def _tensor(p: Path) -> np.ndarray:
    return numpy_helper.to_array(onnx.load_tensor(str(p)))


def node_cases(names: Iterable[str] | None = None) -> list[Case]:
    """The node tests of :data:`NODE_OPS` (all, or those named), generated by the ``onnx`` package.
    Function-expanded variants test the same op through other ops and are left out."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # the generators divide by zero on purpose (inf references)
        generated = node.collect_testcases(None)
    wanted = set(names) if names is not None else None
    cases = []
    for c in generated:
        if wanted is not None and c.name not in wanted:
            continue
        if c.model.graph.node[0].op_type not in NODE_OPS or "expanded" in c.name or not c.data_sets:
            continue
        ins, outs = c.data_sets[0]
        cases.append(Case(NODE, c.name, c.model, tuple(map(np.asarray, ins)), tuple(map(np.asarray, outs))))
    if wanted is not None and len(cases) != len(wanted):
        missing = sorted(wanted - {c.name for c in cases})
        raise ValueError(f"no node test (of NODE_OPS) named {', '.join(missing)} in onnx {onnx.__version__}")
    return sorted(cases, key=lambda c: c.name)


def all_cases() -> list[Case]:
    return [c for s in SUITES for c in data_cases(s)] + node_cases()


# -- one case ----------------------------------------------------------------------------------------


def run_case(case: Case, workdir: Path) -> Outcome:
    """Build ``case`` in ``workdir`` and hold the CPU engine's outputs to the shipped ones."""
    t0 = time.perf_counter()
    model = case.load()
    first = _ort_error(model, case)
    if first is not None and "differs from the shipped outputs" in first:
        return Outcome(case.suite, case.name, "ort", first, seconds=time.perf_counter() - t0)
    single, frozen = freeze_extra_inputs(model, case.inputs)
    x = case.inputs[0] if case.inputs else None
    applied: tuple[str, ...] = ()
    try:
        while True:
            try:
                got, precision = build_and_run(single, x, workdir, applied)
                break
            except DualtrackError as e:
                # What the refusal tells a user to write into the config, where it names one of FIXES.
                fix = next((f for f in FIXES if f"`{f}`" in e.message and f not in applied), None)
                if fix is None:
                    raise
                applied = (*applied, fix)
        status, detail, rel = judge(single, case.outputs, got, precision)
    except InternalError as e:  # a bug: a stage wrote a model the checker rejects, or failed outright
        status, detail, rel = "invalid" if "wrote an invalid model" in e.message else "internal", e.message, None
    except DualtrackError as e:
        status, detail, rel = "refused", e.message, None
    except Exception as e:  # a traceback a user would see: the runner counts it and names it
        status, detail, rel = "traceback", f"{type(e).__name__}: {_first_line(str(e))}", None
    seconds = time.perf_counter() - t0
    if first is not None and status not in BUGS:  # those are bugs whatever onnxruntime does
        # Built from the export's opset upgrade (the front end's check runs on it): the shipped outputs decide.
        built = f"{first}; built: {status}" + (f" ({detail})" if status != "match" else "")
        return Outcome(case.suite, case.name, "ort", built, rel, frozen, seconds, status, applied)
    return Outcome(case.suite, case.name, status, detail, rel, frozen, seconds, fixes=applied)


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""


def data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds (an IR 3 graph also lists its weights as inputs)."""
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _ort_error(model: onnx.ModelProto, case: Case) -> str | None:
    """Why onnxruntime cannot run the shipped model on the shipped inputs, or None."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        feeds = {i.name: x for i, x in zip(data_inputs(model), case.inputs, strict=True)}
        ran = session.run(None, feeds)
    except Exception as e:  # onnxruntime raises its own pybind types; the case only needs the reason
        return f"onnxruntime {ort.__version__}: {_first_line(str(e)) or type(e).__name__}"
    # A build is verified against onnxruntime: where onnxruntime itself disagrees with the shipped outputs
    # (a spec reading it does not share), the case cannot tell whether the build is right.
    got = {o.name: np.asarray(v) for o, v in zip(model.graph.output, ran, strict=True)}
    status, detail, _ = judge(model, case.outputs, got, "fp32" if _all_fp32(case.outputs) else "fp16")
    return None if status == "match" else f"onnxruntime {ort.__version__} differs from the shipped outputs: {detail}"


def _all_fp32(outputs: Sequence[np.ndarray]) -> bool:
    return not any(np.asarray(o).dtype == np.float16 for o in outputs)


def freeze_extra_inputs(model: onnx.ModelProto, inputs: Sequence[np.ndarray]) -> tuple[onnx.ModelProto, int]:
    """The model with every data input after the first given its shipped value as an initializer of
    the same name (left listed as an input, as older exporters list weights: the front end moves it),
    and how many were frozen."""
    extra = data_inputs(model)[1:]
    if not extra:
        return model, 0
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for vi, value in zip(extra, inputs[1:], strict=True):
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), vi.name))
    return model, len(extra)


def build_and_run(
    model: onnx.ModelProto, x: np.ndarray | None, workdir: Path, fixes: tuple[str, ...] = ()
) -> tuple[dict[str, np.ndarray], str]:
    """Build ``model`` for the CPU as a user's config would, with the config lines ``fixes`` (of FIXES),
    run the bundle on ``x``; the outputs by name and the precision built."""
    onnx.save(model, str(workdir / "model.onnx"))
    lines = list(fixes)
    if FIXED_BATCH not in fixes:
        lines.append(f"batch_sizes: [{int(x.shape[0]) if x is not None and x.ndim and x.shape[0] >= 1 else 1}]")
    config = workdir / "case.yaml"
    config.write_text("\n".join(["model: model.onnx", "targets: []", *lines, "verify: {seed: 0}", ""]))
    result = build(config, workdir / f"bundle{len(fixes)}")
    assert result.plan is not None
    if x is None:  # a model without a data input is refused by the front end before this
        raise AssertionError("built a model without a data input")
    want = result.plan.inputs[0].dtype
    if x.dtype == np.float64 and want == "float32":  # `precision: fp32` on a float64 export: as the engine says
        x = x.astype(np.float32)
    with Engine.load(result.bundle, "cpu") as engine:
        return engine.run(x), result.plan.precision


def judge(
    model: onnx.ModelProto, shipped: Sequence[np.ndarray], got: dict[str, np.ndarray], precision: str
) -> tuple[str, str, float | None]:
    """``match`` or ``mismatch``, the worst output's line, and its relative L2 error."""
    tol = DEFAULT_TOLERANCES[precision]
    worst: tuple[float, str] = (0.0, "")
    for out, ref in zip(model.graph.output, shipped, strict=True):
        if out.name not in got:
            return "mismatch", f"the bundle has no output '{out.name}'", None
        r, g = _comparable(np.asarray(ref)), _comparable(np.asarray(got[out.name]))
        if r.shape != g.shape:
            return "mismatch", f"output '{out.name}' has shape {g.shape}, the shipped one {r.shape}", None
        if r.dtype.kind not in "fiub" or g.dtype.kind not in "fiub":  # strings: equal or not
            if not np.array_equal(r, g):
                return "mismatch", f"output '{out.name}' differs from the shipped one", None
            continue
        placed = _nonfinite_placed(r, g)
        if not placed:
            return "mismatch", f"output '{out.name}': non-finite values where the shipped ones are finite", None
        keep = np.isfinite(r) if r.dtype.kind == "f" else np.ones(r.shape, bool)
        check = compare(out.name, r[keep], g[keep], tol)
        if not check.passed:
            worse = f"output '{out.name}': rel_l2 {check.rel_l2:.2e}, max_abs {check.max_abs:.2e}"
            return "mismatch", worse, check.rel_l2
        worst = max(worst, (check.rel_l2, out.name))
    return "match", f"{precision}, worst rel_l2 {worst[0]:.1e}" if worst[1] else precision, worst[0]


def _comparable(a: np.ndarray) -> np.ndarray:
    return a.astype(np.uint8) if a.dtype == bool else a


def _nonfinite_placed(ref: np.ndarray, got: np.ndarray) -> bool:
    """Whether ``got`` is non-finite exactly where ``ref`` is, with the same value (NaN, +inf, -inf)."""
    if ref.dtype.kind != "f" or got.dtype.kind != "f":
        return True
    r, g = ~np.isfinite(ref), ~np.isfinite(got)
    if not np.array_equal(r, g):
        return False
    return bool(np.all((np.isnan(ref[r]) & np.isnan(got[g])) | (ref[r] == got[g])))


# -- many cases --------------------------------------------------------------------------------------


class _CaseTimeout(BaseException):  # not an Exception: run_case must not count it as a traceback
    pass


def _alarm(signum: int, frame: object) -> None:
    # The build waits on its compiler threads, and they on iree-compile: end the tools, then the case.
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    raise _CaseTimeout


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (Linux /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _run_in(case: Case, root: str) -> Outcome:
    """One case in a worker process, stopped after CASE_TIMEOUT_S (subprocess.run kills the tool it waits on)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{case.name}-", dir=root) as d:
            return run_case(case, Path(d))
    except _CaseTimeout:
        return Outcome(case.suite, case.name, "timeout", f"not done after {CASE_TIMEOUT_S} s", seconds=CASE_TIMEOUT_S)
    finally:
        signal.alarm(0)


def run_all(cases: Sequence[Case], jobs: int = 2, progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Every case, ``jobs`` at a time in fresh processes (a build holds the GIL in its Python stages
    and a crash in a native library must not take the others with it); in the order given."""
    root = tempfile.mkdtemp(prefix="dualtrack-conformance-")
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        for outcome in pool.map(_run_in, cases, [root] * len(cases)):
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
    return outcomes


@dataclass(frozen=True)
class Summary:
    """The numbers the issue's targets are stated in."""

    cases: int
    counted: int  # onnxruntime ran them
    matched: int
    by_status: dict[str, int]

    @classmethod
    def of(cls, outcomes: Sequence[Outcome]) -> Summary:
        by = Counter(o.status for o in outcomes)
        counted = sum(o.counted for o in outcomes)
        return cls(len(outcomes), counted, by["match"], {s: by[s] for s in STATUSES})

    @property
    def share(self) -> float:
        return self.matched / self.counted if self.counted else 1.0


def table(outcomes: Sequence[Outcome], header: str = "") -> str:
    """docs/conformance.md: the summary per suite, the refusals grouped by reason, every case."""
    lines = [header.rstrip(), ""] if header else []
    lines += [
        "| suite | cases | onnxruntime runs | build and match | mismatch | refused | timeout | invalid | internal "
        "| traceback |"
    ]
    lines += ["|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, group in _groups(outcomes):
        s = Summary.of(group)
        b = s.by_status
        lines.append(
            f"| {name} | {s.cases} | {s.counted} | {s.matched} ({s.share:.0%}) | {b['mismatch']} | {b['refused']} "
            f"| {b['timeout']} | {b['invalid']} | {b['internal']} | {b['traceback']} |"
        )
    failed = ("refused", "mismatch", "timeout", *BUGS)
    reasons = Counter(_reason(o.detail) for o in outcomes if o.status in failed)
    if reasons:
        lines += ["", "## Why a case does not build and match", "", "| cases | reason |", "|---:|---|"]
        lines += [f"| {n} | {_cell(r)} |" for r, n in reasons.most_common()]
    lines += ["", "## Every case", "", "| suite | case | outcome | inputs frozen | config added | detail |"]
    lines += ["|---|---|---|---:|---|---|"]
    for o in outcomes:
        added = ", ".join(f"`{f}`" for f in o.fixes)
        lines.append(f"| {o.suite} | {o.name} | {o.status} | {o.frozen or ''} | {added} | {_cell(o.detail)} |")
    return "\n".join(lines) + "\n"


def _added(outcomes: Sequence[Outcome], fix: str) -> int:
    """How many cases were built with the config line ``fix`` added (:data:`FIXES`)."""
    return sum(fix in o.fixes for o in outcomes)


def _ort_matched(outcomes: Sequence[Outcome]) -> int:
    return sum(o.status == "ort" and o.built == "match" for o in outcomes)


def _groups(outcomes: Sequence[Outcome]) -> list[tuple[str, list[Outcome]]]:
    """Each suite, the three model-test suites together, and everything; empty groups left out."""
    groups = [(s, [o for o in outcomes if o.suite == s]) for s in SUITES]
    groups += [("model tests", [o for o in outcomes if o.suite in SUITES])]
    groups += [(NODE, [o for o in outcomes if o.suite == NODE]), ("all", list(outcomes))]
    return [(name, group) for name, group in groups if group]


def _reason(detail: str) -> str:
    """A refusal without the case's own names and numbers, so that alike refusals group together."""
    text = re.sub(r"\[ShapeInferenceError\].*?;", "…;", _unplaced(detail))  # the op's complaint, up to the fix
    text = re.sub(r"'[^'\s]*'", "'…'", text)
    text = re.sub(r"\(\d[^)]*\)|\b\d+(\.\d+)?(e-?\d+)?\b", "…", text)
    return text[:240]


def _cell(text: str) -> str:
    return _unplaced(text).replace("|", "\\|").replace("\n", " ")


def _unplaced(text: str) -> str:
    """``text`` without the temporary and cache folders of this run (a build's repro command names them)."""
    return re.sub(r"(?:/tmp|/[\w.-]+/\.cache)/[\w./-]*/", "…/", text)


def header(outcomes: Sequence[Outcome], seconds: float, jobs: int) -> str:
    """What the table is, how it was made and the issue's numbers."""
    tools = ", ".join(f"{p} {version(p)}" for p in ("onnx", "onnxruntime", "iree-base-compiler"))
    summary = Summary.of(outcomes)
    b = summary.by_status
    models = Summary.of([o for o in outcomes if o.suite in SUITES])
    nodes = Summary.of([o for o in outcomes if o.suite == NODE])
    return "\n".join(
        [
            "# Front-end conformance: ONNX's own test models",
            "",
            "Generated by `make conformance` (`python -m dualtrack.compiler.conformance`; do not edit by hand): "
            "every model test the `onnx` package ships (`pytorch-converted`, `pytorch-operator`, `simple`) and the "
            "node tests of the ops a segmentation model uses, built for the CPU (IREE llvm-cpu) as a user's config "
            "would build them and run on their shipped inputs against their shipped outputs at the precision's "
            "default tolerance. How each case is built: the module docstring of "
            "`pipeline/dualtrack/compiler/conformance.py`. Inputs after the first are frozen to their shipped "
            "values (dualtrack serves single-input models); `ort` cases are those onnxruntime cannot run as "
            "shipped, or computes differently from the shipped outputs: they are listed, not counted.",
            "",
            f"{tools}; {summary.cases} cases in {seconds / 60:.1f} min on {jobs} processes.",
            "",
            f"**{summary.matched} of the {summary.counted} cases onnxruntime runs build and match "
            f"({summary.share:.1%})**: model tests {models.matched} of {models.counted} ({models.share:.0%}), "
            f"node tests {nodes.matched} of {nodes.counted} ({nodes.share:.0%}); {b['refused']} refused with one "
            f"line, {b['mismatch']} mismatch, {b['timeout']} timeout, {b['invalid']} invalid models written, "
            f"{b['internal']} internal errors, {b['traceback']} tracebacks; {b['ort']} `ort`, of which "
            f"{_ort_matched(outcomes)} build anyway (from their opset upgrade, which the front end checks against "
            "in onnxruntime) and match their shipped outputs.",
            "",
            "By default dualtrack runs a model image by image along dim 0 of its input, so a graph whose dim 0 "
            "holds data rather than a batch (a reduction, softmax, split or concat over axis 0, or an operand with "
            "rows of its own, as many node tests and the frozen inputs of multi-input tests have) is refused by "
            "the batch check with one line that names `batch: fixed`; the runner then adds that line, which builds "
            f"the exported shape whole ({_added(outcomes, FIXED_BATCH)} cases). A float64 export is refused naming "
            f"`precision: fp32`, which builds it in float32 ({_added(outcomes, 'precision: fp32')} cases). "
            "Sequence and string graphs are refused.",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run every case (or one suite) and write the table; exit 1 if a case ends in a bug of dualtrack's
    (an invalid model written, an internal error, a traceback)."""
    ap = argparse.ArgumentParser(prog="python -m dualtrack.compiler.conformance", description=main.__doc__)
    ap.add_argument("--out", type=Path, default=Path("docs/conformance.md"), help="where the table goes")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="cases built at a time")
    ap.add_argument("--suite", choices=[*SUITES, NODE], action="append", help="only these suites (repeatable)")
    args = ap.parse_args(argv)
    suites = args.suite or [*SUITES, NODE]
    cases = [c for s in suites if s != NODE for c in data_cases(s)] + (node_cases() if NODE in suites else [])
    t0 = time.perf_counter()

    def say(o: Outcome) -> None:
        print(f"{o.suite}/{o.name}: {o.status} {o.detail}", flush=True)

    outcomes = run_all(cases, args.jobs, say)
    summary = Summary.of(outcomes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(outcomes, header(outcomes, time.perf_counter() - t0, args.jobs)))
    print(f"wrote {args.out}: {summary.matched}/{summary.counted} build and match ({summary.share:.1%})")
    return 1 if any(summary.by_status[s] for s in BUGS) else 0


if __name__ == "__main__":
    raise SystemExit(main())
