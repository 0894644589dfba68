"""The bundle: one directory that holds everything a runtime needs, written atomically.

Layout::

    manifest.json                 contract.manifest.Manifest: format, model hash, plan, artifacts, tools, file
                                  hashes, and the weights' index into weights.bin
    model.onnx                    the (node-named) source model, its initializers ONNX external data in weights.bin
    weights.bin                   the weights, once: what the kernels, IREE's parameters and model.onnx read
    segments/segK_T.onnx          each segment's graph, without weight data
    iree/segK_T/<target>/bN.vmfb  Track B modules (and Track A segments for llvm-cpu), weights externalized
    track_a/ptx/<arch>/*.ptx      hand-written kernels as PTX; track_a/cubin/<sm>/*.cubin assembled from them
    verify.json                   the build-time verification report
    verify/cases.npz              reference cases: inputs and onnxruntime's outputs (contract/cases.py)

A bundle is written into a temporary sibling directory (compiler/bundle.py's BundleWriter) and renamed
into place only once it is complete and verified; `manifest.json` is written last and lists the
SHA-256 of every other file, so a truncated or edited bundle is refused at load. This module reads
one, with numpy alone: a serving process never imports onnx.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from dualtrack.contract.cases import ReferenceCases
from dualtrack.contract.checks import DEFAULT_TOLERANCES, Tolerance
from dualtrack.contract.manifest import Manifest
from dualtrack.contract.plan import Plan, Segment
from dualtrack.contract.sizes import Size, label, sorted_sizes
from dualtrack.errors import BundleError

MANIFEST = "manifest.json"
MODEL = "model.onnx"
WEIGHTS = "weights.bin"
CASES = "verify/cases.npz"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_digest(files: Mapping[str, str]) -> str | None:
    """The model's identity, ``ModelInfo.sha256``: a hash of model.onnx's and weights.bin's hashes
    (``files``: path -> SHA-256), so that neither the graph nor the weights can be swapped alone.
    None while either is missing."""
    if MODEL not in files or WEIGHTS not in files:
        return None
    return sha256(f"{MODEL} {files[MODEL]}\n{WEIGHTS} {files[WEIGHTS]}\n".encode())


@dataclass
class Bundle:
    """A bundle opened for reading, its integrity checked."""

    root: Path
    manifest: Manifest
    # This view's graph and reference cases: the bundle's own, or one input size's (:meth:`at_size`).
    model_file: str = MODEL
    cases_file: str = CASES

    @classmethod
    def open(cls, path: str | Path, *, check_hashes: bool = True) -> Bundle:
        root = Path(path)
        if not root.is_dir():
            raise BundleError(f"bundle {root} not found; build one with `dualtrack build CONFIG -o {root}`")
        mpath = root / MANIFEST
        try:
            raw = json.loads(mpath.read_text())
        except FileNotFoundError:
            raise BundleError(
                f"{root} has no {MANIFEST}: not a dualtrack bundle, or its build did not finish; rebuild it"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BundleError(f"{mpath} is corrupt ({e.__class__.__name__}); rebuild the bundle") from None
        manifest = Manifest.from_json(raw, str(root))
        for rel, digest in manifest.files.items():
            f = root / rel
            if not f.is_file():
                raise BundleError(f"{root} is incomplete: {rel} is missing; rebuild the bundle")
            if check_hashes and sha256(f.read_bytes()) != digest:
                raise BundleError(
                    f"{root}: {rel} does not match its recorded hash (truncated or modified); rebuild the bundle"
                )
        # The modules were compiled from the model whose hash the build recorded: a model.onnx or
        # weights.bin swapped in (its entry in `files` patched to match) would run other weights
        # through code built for these.
        digest = model_digest(manifest.files)
        if digest != manifest.model.sha256:
            raise BundleError(
                f"{root}: {MODEL} and {WEIGHTS} are not the model its modules were built from (sha256 "
                f"{(digest or 'missing')[:12]}, built from {manifest.model.sha256[:12]}); rebuild the bundle"
            )
        return cls(root, manifest)

    @property
    def plan(self) -> Plan:
        return self.manifest.plan

    @property
    def model_sha256(self) -> str:
        return self.manifest.model.sha256

    def check_model(self, model_path: Path) -> None:
        """Refuse a bundle built from another model file."""
        digest = sha256(Path(model_path).read_bytes())
        if digest != self.manifest.model.source_sha256:
            raise BundleError(
                f"{self.root} was built from another model (sha256 {self.manifest.model.source_sha256[:12]}, "
                f"{model_path} is {digest[:12]}); rebuild the bundle from {model_path}"
            )

    @cached_property
    def weights(self) -> dict[str, np.ndarray]:
        """Every initializer of the model, name -> read-only array mapped from weights.bin (the
        manifest's index says where): processes that serve one bundle share the pages."""
        path = self.root / WEIGHTS
        data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
        out: dict[str, np.ndarray] = {}
        for name, w in self.manifest.weights.items():
            dtype = np.dtype(w.dtype).newbyteorder("<")
            if w.offset + w.length > data.size or w.length != dtype.itemsize * int(np.prod(w.shape, dtype=np.int64)):
                raise BundleError(
                    f"{self.root}: weight {name} ({w.dtype}{list(w.shape)}, {w.length} bytes at {w.offset}) does "
                    f"not fit {WEIGHTS} ({data.size} bytes); rebuild the bundle"
                )
            out[name] = data[w.offset : w.offset + w.length].view(dtype).reshape(w.shape)
        return out

    def tolerance(self) -> Tolerance:
        """The tolerance the build verified at (the manifest's record), else the config's
        `verify.tolerance`, else the precision's default: what a later check of this bundle holds it to."""
        ver = self.manifest.verification
        raw = (
            (ver.tolerance if ver is not None else None)
            or self.manifest.tolerance
            or self.manifest.config.get("verify", {}).get("tolerance")
        )
        return Tolerance(**raw) if raw else DEFAULT_TOLERANCES[self.plan.precision]

    @cached_property
    def cases(self) -> ReferenceCases:
        """The reference cases the build stored (contract/cases.py) for the first-load check."""
        return ReferenceCases.load(self.root / self.cases_file)

    @property
    def size(self) -> Size | None:
        """(H, W) of this view's plan: an image plan's (N, H, W, 3) input; None for other inputs."""
        shape = self.plan.inputs[0].shape if self.plan.inputs else ()
        return (shape[1], shape[2]) if len(shape) == 4 and shape[3] == 3 else None

    @property
    def sizes(self) -> tuple[Size, ...]:
        """Every input size the bundle was built for, smallest first (one for a one-size image bundle)."""
        own = () if self.size is None else (self.size,)
        return sorted_sizes([*own, *((s.height, s.width) for s in self.manifest.sizes)])

    def at_size(self, size: Size) -> Bundle:
        """The bundle as built for one input ``size``: its plan, modules, graph and reference cases
        (the weights are the bundle's). Itself for the manifest's own size."""
        if size == self.size:
            return self
        entry = next((s for s in self.manifest.sizes if (s.height, s.width) == tuple(size)), None)
        if entry is None:
            have = ", ".join(label(s) for s in self.sizes) or "none"
            raise BundleError(f"{self.root} has no plan for {label(size)} (has {have}); add it to `sizes` and rebuild")
        manifest = replace(
            self.manifest,
            # A key of its own: what is recorded of one size (the first GPU load's checks) is not another's.
            build_key=sha256(f"{self.manifest.build_key} {label(size)}".encode()),
            plan=entry.plan,
            artifacts=entry.artifacts,
            verification=entry.verification,
            sizes=(),
        )
        return replace(self, manifest=manifest, model_file=entry.model, cases_file=entry.cases)

    def vmfb(self, seg: Segment, target: str, batch: int) -> Path:
        try:
            rel = self.manifest.artifacts.iree[seg.name][target][str(batch)]
        except KeyError:
            have = sorted(self.manifest.artifacts.iree.get(seg.name, {}))
            raise BundleError(
                f"{self.root} has no {target} module for {seg.name} at batch {batch} "
                f"(has: {', '.join(have) or 'none'}); "
                "add the target or batch size to the config and rebuild"
            ) from None
        return self.root / rel

    @property
    def iree_targets(self) -> list[str]:
        return sorted({t for seg in self.manifest.artifacts.iree.values() for t in seg})

    @property
    def track_a(self) -> Mapping[str, Any]:
        return self.manifest.artifacts.track_a

    def tuned_calls(self, cc: tuple[int, int]) -> dict[str, dict[str, str]]:
        """The tuned entry of each Track A conv layer (Conv node -> batch size -> entry) that the
        build chose for the target of compute capability ``cc``; empty where nothing was tuned."""
        tuned = self.track_a.get("tuned", {})
        for t in self.manifest.targets:
            if t.arch in tuned and t.cc_tuple == tuple(cc):
                return tuned[t.arch]["calls"]
        return {}
