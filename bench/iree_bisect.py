"""Where IREE alone goes wrong on the GPU: a model's fp16 graph cut after each of its chosen nodes, each
prefix compiled for CUDA here (Track B's own job: stage 0, import, compile), run there through Track B's
runtime module against onnxruntime on the same prefix. The first prefix whose error jumps names the op.

    # here, where iree-compile is (about 15 s of compile per prefix on two cores):
    PYTHONPATH=pipeline .venv/bin/python bench/iree_bisect.py build configs/zoo/monai_unet.yaml .carry/bisect/monai_unet
    PYTHONPATH=pipeline .venv/bin/python bench/iree_bisect.py build configs/zoo/smp_pspnet_resnet34.yaml \\
        .carry/bisect/pspnet --ops AveragePool GlobalAveragePool Resize Concat --old
    # on the GPU machine (onnxruntime and the IREE runtime; no compiler):
    PYTHONPATH=pipeline python3 bench/iree_bisect.py run .carry/bisect/monai_unet [--bundle BUNDLE] --out $OUT

``--old``: the prefixes compiled without stage 0's fp32 sums (iree_forms.fp32_sums), as before it.
``--bundle``: the weights of that bundle of the same config (an IREE-alone bundle regrown by
bench/reweight.py: the weights the zoo bench's failing rows had) instead of the export's, which the kit
carries. Each prefix's module takes the weights by name, so any weights of the same graph serve.
Writes ``iree_bisect-<kit name>.json``: per prefix the tensor, its op and the relative L2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
from onnx import numpy_helper

DEFAULT_OPS = ("InstanceNormalization", "AveragePool", "GlobalAveragePool", "Resize", "Concat", "Add")
ENTRY = "main"


def prefix(model: onnx.ModelProto, tensor: str) -> onnx.ModelProto:
    """The model up to ``tensor`` (its one output), batch 1, the graph named as Track B's segments are."""
    from dualtrack.compiler.partition import with_batch

    inp = model.graph.input[0].name
    typed = onnx.shape_inference.infer_shapes(with_batch(model, 1))  # the Extractor reads the cut's type there
    cut = onnx.utils.Extractor(typed).extract_model([inp], [tensor])
    cut.graph.name = ENTRY
    return cut


def cuts(model: onnx.ModelProto, ops: tuple[str, ...], most: int) -> list[tuple[str, str]]:
    """(tensor, op) after each node of ``ops``, at most ``most`` of them spread evenly, and the float output
    (the probabilities: the mask's argmax hides an error until it flips a class)."""
    found = [(n.output[0], n.op_type) for n in model.graph.node if n.op_type in ops]
    if len(found) > most:
        found = [found[round(i * (len(found) - 1) / (most - 1))] for i in range(most)] if most > 1 else found[-1:]
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    last = next(o.name for o in model.graph.output if o.type.tensor_type.elem_type in floats)
    return [*found, (last, "output")]


def build(config: Path, dest: Path, ops: tuple[str, ...], most: int, old: bool) -> None:
    from dualtrack.compiler import frontend
    from dualtrack.compiler import iree_build as tb
    from dualtrack.compiler.config import load_config
    from dualtrack.contract import arch

    cfg, fe = frontend.load(load_config(config))
    dest.mkdir(parents=True, exist_ok=True)
    onnx.save(fe.model, str(dest / "model.onnx"))
    iree_arch = cfg.track_b.iree_target or arch.resolve(cfg.targets[0]).iree_target
    target, flags = tb.cuda_target(iree_arch), (*cfg.track_b.flags, *cfg.track_b.cuda_flags)
    cache, compiler = tb.ModuleCache(dest / ".cache", enabled=False), tb.compiler_version()
    rows = []
    with mock.patch.object(tb, "fp32_sums", (lambda m: m) if old else tb.fp32_sums):
        for k, (tensor, op) in enumerate(cuts(fe.model, ops, most)):
            job = tb.CompileJob(f"p{k:02d}", prefix(fe.model, tensor), 1, target, flags)
            (dest / f"p{k:02d}.vmfb").write_bytes(tb.run_job(job, cache, compiler).vmfb)
            rows.append({"file": f"p{k:02d}.vmfb", "tensor": tensor, "op": op})
            print(f"p{k:02d} {op:22s} {tensor}", flush=True)
    kit = {"config": str(config), "target": target.name, "flags": list(flags), "fp32_sums": not old, "prefixes": rows}
    (dest / "bisect.json").write_text(json.dumps(kit, indent=1))


def _weights(kit: Path, bundle: Path | None) -> dict[str, np.ndarray]:
    model = onnx.load(str(kit / "model.onnx"))
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    if bundle is not None:
        from dualtrack.contract.bundle import Bundle

        theirs = Bundle.open(bundle).weights
        missing = sorted(set(weights) - set(theirs))
        if missing:
            raise SystemExit(f"{bundle} lacks {len(missing)} of the kit's weights ({missing[0]}, ...): another graph")
        weights = {k: np.asarray(theirs[k]) for k in weights}
    return weights


def run(kit: Path, bundle: Path | None, out: Path, seed: int) -> None:
    from dualtrack.compiler.partition import attach_initializers
    from dualtrack.compiler.verify import ort_session
    from dualtrack.runtime.iree import IreeDevice, IreeModule, parameter_index

    meta = json.loads((kit / "bisect.json").read_text())
    weights = _weights(kit, bundle)
    graph = onnx.load(str(kit / "model.onnx"))
    inp = graph.graph.input[0]
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    x = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)  # the image wrap's uint8 input
    device, index = IreeDevice.create("cuda"), parameter_index(weights)
    rows = []
    for row in meta["prefixes"]:
        cut = prefix(graph, row["tensor"])
        del cut.graph.initializer[:]  # the weights the module reads, not the export's the kit carries
        want = ort_session(attach_initializers(cut, weights), row["tensor"]).run(None, {inp.name: x})[0]
        module = IreeModule(device, kit / row["file"], index, ENTRY)
        got = np.array(module(x)[0].to_host(), copy=True)
        del module
        a, b = got.astype(np.float64), want.astype(np.float64)
        err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        rows.append({**row, "rel_l2": err, "finite": bool(np.isfinite(got).all())})
        print(f"{row['file']} {row['op']:22s} rel_l2 {err:.3e} {row['tensor']}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    result = {**meta, "bundle": str(bundle) if bundle else None, "seed": seed, "prefixes": rows}
    (out / f"iree_bisect-{kit.name}.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the prefixes here")
    b.add_argument("config", type=Path)
    b.add_argument("dest", type=Path)
    b.add_argument("--ops", nargs="+", default=list(DEFAULT_OPS))
    b.add_argument("--most", type=int, default=12, help="at most this many cuts, spread evenly")
    b.add_argument("--old", action="store_true", help="without stage 0's fp32 sums")
    r = sub.add_parser("run", help="run them on the GPU")
    r.add_argument("kit", type=Path)
    r.add_argument("--bundle", type=Path)
    r.add_argument("--out", type=Path, default=Path("."))
    r.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.config, args.dest, tuple(args.ops), args.most, args.old)
    else:
        run(args.kit, args.bundle, args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
