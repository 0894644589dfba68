"""Carry a corpus bundle to the GPU machine without its weights, and grow them back there, byte for byte.

    python bench/reweight.py seal BUNDLE [SHARING ...]   # here, after `dualtrack build`
    python bench/reweight.py regrow BUNDLE [SHARING ...]  # on the GPU machine, before loading

Why: the carry is 64 MiB a call and a ResNet-34 corpus model's fp16 weights alone are ~48 MB, so the
corpus cannot travel with its weights. Timing does not depend on the weights' values, only on their
shapes, provided they keep the activations' scale (no overflow to inf, no denormals). So ``seal``
replaces the bundle's weights with values a seeded generator draws (numpy's PCG64, the same bytes on
every platform and numpy version): per output channel (a tensor's leading dimension) the same mean and
standard deviation as the export's (the folded batch norms' per-channel scales survive, so activations
keep their scale), tensors of at most ``EXACT_MAX`` elements kept as they are. It writes what is needed
to draw them again (``weights.regrow.npz``: per-channel statistics and the small tensors, a few hundred
KB), recomputes the reference cases (``verify/cases.npz``: onnxruntime on the re-weighted model) and the
manifest's hashes. ``regrow`` draws ``weights.bin`` again from that file and checks its SHA-256 against
the manifest (the bundle then opens with every hash checked); reference cases it lacks (they weigh
~6 MB at 512x512 and need not travel) it recomputes with onnxruntime there, recording their new hash.

``SHARING``: other bundles of the same model (the IREE-alone bundle beside a corpus bundle) get the
same weights.bin and their own cases; their manifests are updated alike. The torch rows of
bench/zoo_bench.py build their own network from the seeded export and are checked against their own
fp32 run (not against the bundle's re-weighted model).

Not for serving: a bench tool. A sealed bundle's ``ModelInfo.source_sha256`` still names the export it
was built from, its weights are not that export's, and ``weights.regrow.npz`` in its file list says so.
"""

from __future__ import annotations

import hashlib
import json
import sys
from io import BytesIO
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "pipeline"))

from dualtrack.atomic import write_bytes  # noqa: E402
from dualtrack.contract.bundle import CASES, MANIFEST, WEIGHTS, Bundle, model_digest, sha256  # noqa: E402
from dualtrack.contract.manifest import Manifest  # noqa: E402

REGROW = "weights.regrow.npz"
EXACT_MAX = 4096  # tensors this small (biases, norm scales, small heads) travel as they are


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def draw(name: str, shape: tuple[int, ...], dtype: str, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """A tensor's seeded values: per leading index k, mean[k] + std[k] * N(0, 1), in its dtype."""
    rows = shape[0] if shape else 1
    z = _rng(name).standard_normal((rows, int(np.prod(shape[1:], dtype=np.int64)) if shape else 1))
    return (mean[:, None] + std[:, None] * z).astype(dtype).reshape(shape)


def _stats(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = w.astype(np.float64).reshape(w.shape[0] if w.ndim else 1, -1)
    return rows.mean(axis=1), rows.std(axis=1)


def _grown(manifest: dict, regrow: np.lib.npyio.NpzFile | dict) -> bytes:
    """weights.bin's bytes from the manifest's index and the regrow file."""
    size = max((w["offset"] + w["length"] for w in manifest["weights"].values()), default=0)
    out = bytearray(size)
    for name, w in manifest["weights"].items():
        if f"exact/{name}" in regrow:
            arr = np.asarray(regrow[f"exact/{name}"])
        else:
            arr = draw(name, tuple(w["shape"]), w["dtype"], regrow[f"mean/{name}"], regrow[f"std/{name}"])
        data = np.ascontiguousarray(arr.astype(np.dtype(w["dtype"]).newbyteorder("<"))).tobytes()
        assert len(data) == w["length"], name
        out[w["offset"] : w["offset"] + w["length"]] = data
    return bytes(out)


def _cases(bundle_dir: Path, seed: int) -> bytes:
    from dualtrack.compiler.bundle_writer import load_model  # onnx + onnxruntime: here and on the GPU machine
    from dualtrack.compiler.verify import reference_cases

    # Not Bundle.open: the cases being made are missing or stale; the weights were checked before.
    b = Bundle(bundle_dir, Manifest.from_json(json.loads((bundle_dir / MANIFEST).read_text()), str(bundle_dir)))
    model = load_model(b)
    return reference_cases(model, b.plan, seed).to_bytes()


def _judged(bundle_dir: Path) -> dict[str, float]:
    """The bundle's tolerance judged again on its (re-weighted) model, as the build judges it."""
    from dualtrack.compiler.bundle_writer import load_model
    from dualtrack.compiler.verify import judged_tolerance

    b = Bundle(bundle_dir, Manifest.from_json(json.loads((bundle_dir / MANIFEST).read_text()), str(bundle_dir)))
    return judged_tolerance(load_model(b), b.plan, 0)[0].to_json()


def _record(bundle_dir: Path, manifest: dict, files: dict[str, bytes]) -> None:
    """Write ``files`` into the bundle and their hashes (and the model's identity) into its manifest."""
    for rel, data in files.items():
        write_bytes(bundle_dir / rel, data)
        manifest["files"][rel] = sha256(data)
    manifest["files"] = dict(sorted(manifest["files"].items()))
    manifest["model"]["sha256"] = model_digest(manifest["files"])
    write_bytes(bundle_dir / MANIFEST, json.dumps(manifest, indent=2).encode())


def seal(bundle_dir: Path, sharing: list[Path]) -> None:
    b = Bundle.open(bundle_dir)
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    regrow: dict[str, np.ndarray] = {}
    for name, w in b.weights.items():
        if w.size <= EXACT_MAX or w.ndim == 0 or not np.issubdtype(w.dtype, np.floating):
            regrow[f"exact/{name}"] = np.array(w)
        else:
            regrow[f"mean/{name}"], regrow[f"std/{name}"] = _stats(np.asarray(w))
    del b
    weights = _grown(manifest, regrow)
    seed = int(np.load(bundle_dir / CASES)["seed"])
    regrow["cases_seed"] = np.int64(seed)
    buf = BytesIO()
    np.savez_compressed(buf, **regrow)
    for d in (bundle_dir, *sharing):
        m = json.loads((d / MANIFEST).read_text())
        _record(d, m, {WEIGHTS: weights, REGROW: buf.getvalue()})
        if m.get("tolerance") and not m["config"].get("verify", {}).get("tolerance"):
            m["tolerance"] = _judged(d)  # the re-weighted network's fp16 error, not the export's
        _record(d, m, {CASES: _cases(d, seed)})
        Bundle.open(d)  # every hash checks out
        kb = len(buf.getvalue()) / 1e3
        print(f"sealed {d}: {len(weights) / 1e6:.1f} MB of weights, drawn again from {REGROW} ({kb:.0f} KB)")


def regrow(bundle_dir: Path, sharing: list[Path]) -> None:
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    with np.load(bundle_dir / REGROW) as z:
        stored = {k: z[k] for k in z.files}
    weights = _grown(manifest, stored)
    if sha256(weights) != manifest["files"][WEIGHTS]:
        raise SystemExit(f"{bundle_dir}: the regrown {WEIGHTS} does not match its recorded hash (another numpy?)")
    for d in (bundle_dir, *sharing):
        m = json.loads((d / MANIFEST).read_text())
        write_bytes(d / WEIGHTS, weights)
        if not (d / CASES).is_file():
            _record(d, m, {CASES: _cases(d, int(stored["cases_seed"]))})
        Bundle.open(d)
        print(f"regrew {d}: {len(weights) / 1e6:.1f} MB of weights, hashes checked")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("seal", "regrow"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    (seal if argv[0] == "seal" else regrow)(Path(argv[1]), [Path(p) for p in argv[2:]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
