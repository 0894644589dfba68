#!/usr/bin/env python3
"""Where a bundle's GPU run departs from onnxruntime: the bundle's own reference cases (its first-load
self-check's images) run segment by segment at every compiled batch size, each segment's GPU outputs
compared with onnxruntime's run of that segment (fp32, upcast) on the very inputs the GPU segment read.

Three things a whole-plan check cannot tell apart are told apart here:

- a segment that computes wrong on its own inputs (its row is over the tolerance); for a Track A
  segment every kernel call is then compared with its numpy semantics on the GPU's own inputs to
  that call (the planned buffers keep each intermediate until the next run), and for a replayed Track
  B segment the IREE runtime's answer is put beside the replay's;
- a tensor changed between the segment that wrote it and the one that reads it (``clobbered``: a
  buffer shared where it must not be, or a write still in flight);
- error that only grows along the chain (every row within tolerance, the last one not).

    DUALTRACK_GPU_SELF_CHECK=0 python bench/segment_trace.py BUNDLE [--batches 1 8] [--out F.json]

Needs a GPU and onnxruntime; no compiler run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from dualtrack import kernels
from dualtrack.compiler.bundle_writer import segment_model
from dualtrack.compiler.verify import ort_session, run_ort, upcast
from dualtrack.contract.plan import ALIAS_OPS
from dualtrack.runtime.engine import Engine

REL_FLAG = 0.02  # a row above this relative L2 error is printed as suspect (fp16 storage alone: ~1e-3)


def err(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    r, g = ref.astype(np.float64), got.astype(np.float64)
    if r.shape != g.shape:
        return {"rel_l2": float("inf"), "max_abs": float("inf"), "nonfinite": -1}
    bad = ~np.isfinite(g)
    d = np.where(bad, 0.0, g - r)
    rows = [float(np.linalg.norm(d[i]) / max(np.linalg.norm(r[i]), 1e-30)) for i in range(r.shape[0])] if r.ndim else []
    return {
        "rel_l2": float(np.linalg.norm(d) / max(np.linalg.norm(r), 1e-30)),
        "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
        "nonfinite": int(bad.sum()),
        # per batch row: the cases tile K images over the rows, so a row that alone is off names its image
        "worst_row": int(np.argmax(rows)) if rows else -1,
        "rows_nonfinite": [int(bad[i].sum()) for i in range(r.shape[0])] if r.ndim else [],
    }


def suspect(e: dict[str, float]) -> bool:
    return e["nonfinite"] > 0 or e["rel_l2"] > REL_FLAG


def trace_calls(engine: Engine, seg, batch: int, host_in: dict[str, np.ndarray]) -> list[dict]:
    """Every kernel call of a Track A segment that just ran: its GPU output against its numpy
    semantics on the GPU's own inputs to it."""
    backend = engine.backend
    views, _roots = backend.track_a._plan_buffers(seg, batch)
    weights = engine.bundle.weights
    host = dict(host_in)
    rows = []
    for c in seg.calls:
        for name in (*c.inputs, *c.outputs):
            if name not in host and name in views:
                host[name] = backend.to_host(views[name])
        if c.op in ALIAS_OPS:
            continue
        args = [host[i] for i in c.inputs]
        t0 = time.perf_counter()
        ref = kernels.kernel(c.op).run_reference(c, args, weights)
        ref = ref if isinstance(ref, tuple) else (ref,)
        for name, r in zip(c.outputs, ref, strict=True):
            e = err(np.asarray(r), host[name])
            rows.append(
                {
                    "op": c.op,
                    "nodes": list(c.nodes[:3]),
                    "output": name,
                    **e,
                    "ref_s": round(time.perf_counter() - t0, 2),
                }
            )
            if suspect(e):
                print(
                    f"      call {c.op:<14} -> {name}: rel_l2 {e['rel_l2']:.3g} max_abs {e['max_abs']:.3g} "
                    f"nonfinite {e['nonfinite']}",
                    flush=True,
                )
    return rows


def trace(bundle_dir: str, batches: list[int] | None, device: str) -> dict:
    out: dict = {"bundle": bundle_dir, "device": device, "batches": {}}
    with Engine.load(bundle_dir, device=device) as engine:
        backend, plan, bundle = engine.backend, engine.plan, engine.bundle
        gpu_run = device == "cuda"
        backend.poison = gpu_run  # Track A outputs NaN-filled before each run: an unwritten element shows
        sessions = {}
        for b in batches or plan.batch_sizes:
            x = bundle.cases.batch(b)
            name_in = plan.inputs[0].name
            gpu = {name_in: backend.from_host(x)}
            host = {name_in: x}
            rows = []
            traced = False  # the calls of the first suspect segment only: numpy at batch 8 is slow
            for seg in plan.segments:
                clobbered = []
                for t in seg.inputs:
                    now = backend.to_host(gpu[t.name])
                    if not np.array_equal(now, host[t.name], equal_nan=True):
                        clobbered.append(t.name)
                ins = {t.name: gpu[t.name] for t in seg.inputs}
                outs = backend.run_segment(seg, b, ins)
                got = {k: backend.to_host(v) for k, v in outs.items()}
                if seg.name not in sessions:
                    sessions[seg.name] = ort_session(upcast(segment_model(bundle, seg)), f"segment {seg.name}")
                ref = run_ort(sessions[seg.name], {t.name: host[t.name] for t in seg.inputs})
                path = seg.track if seg.track == "A" or not gpu_run else f"B/{backend.track_b.decide(seg, b).path}"
                for o in seg.outputs:
                    e = err(ref[o.name], got[o.name])
                    row = {"segment": seg.name, "track": path, "output": o.name, "clobbered": clobbered, **e}
                    flag = "  <-- SUSPECT" if suspect(e) or clobbered else ""
                    print(
                        f"b{b} {seg.name:<10} {path:<9} {o.name[:38]:<38} rel_l2 {e['rel_l2']:.3g} "
                        f"max_abs {e['max_abs']:.3g} nonfinite {e['nonfinite']} worst row {e['worst_row']}"
                        f"{' clobbered ' + ','.join(clobbered) if clobbered else ''}{flag}",
                        flush=True,
                    )
                    rows.append(row)
                if not traced and any(suspect(r) for r in rows[-len(seg.outputs) :]):
                    traced = True
                    if seg.track == "A" and gpu_run:
                        rows[-1]["calls"] = trace_calls(engine, seg, b, {t.name: host[t.name] for t in seg.inputs})
                    elif path == "B/replay":
                        iree, _ms = backend.track_b.run(seg, b, ins, before_call=backend.stream.synchronize)
                        for o in seg.outputs:
                            e = err(ref[o.name], backend.to_host(iree[o.name]))
                            rows[-1].setdefault("iree_runtime", {})[o.name] = e
                            print(
                                f"      IREE runtime instead of replay: {o.name[:38]} rel_l2 {e['rel_l2']:.3g} "
                                f"max_abs {e['max_abs']:.3g} nonfinite {e['nonfinite']}",
                                flush=True,
                            )
                gpu.update(outs)
                host.update(got)
            # the whole plan as served (one graph where it can), against the chain above
            backend.poison = False
            whole = engine.run(x)
            backend.poison = gpu_run
            for o in plan.outputs:
                e = err(host[o.name], np.asarray(whole[o.name]))
                print(
                    f"b{b} whole plan vs segment chain: {o.name} rel_l2 {e['rel_l2']:.3g} max_abs {e['max_abs']:.3g}",
                    flush=True,
                )
                rows.append({"segment": "whole_plan_vs_chain", "output": o.name, **e})
            for c in bundle.cases.check(whole, b, bundle.tolerance(), f"plan b{b}"):  # the self-check's own
                print(
                    f"b{b} self-check: {c.name} rel_l2 {c.rel_l2:.3g} max_abs {c.max_abs:.3g} "
                    f"mismatch {c.mismatch:.3g} {'ok' if c.passed else 'FAILS'}",
                    flush=True,
                )
                rows.append(
                    {
                        "segment": "self_check",
                        "output": c.name,
                        "rel_l2": c.rel_l2,
                        "max_abs": c.max_abs,
                        "mismatch": c.mismatch,
                        "passed": c.passed,
                    }
                )
            out["batches"][str(b)] = rows
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+")
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args(argv)
    os.environ.setdefault("DUALTRACK_GPU_SELF_CHECK", "0")
    results = []
    for bdir in a.bundles:
        print(f"== {bdir}", flush=True)
        try:
            results.append(trace(bdir, a.batches, a.device))
        except Exception as exc:  # one bundle's failure is a finding, not the end of the run
            print(f"{bdir}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            results.append({"bundle": bdir, "error": f"{type(exc).__name__}: {exc}"})
    if a.out:
        a.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
