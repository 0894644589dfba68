"""The bundle: one directory that holds everything a runtime needs, written atomically.

Layout::

    manifest.json                 contract.manifest.Manifest: format, model hash, plan, artifacts, tools, file hashes
    model.onnx                    the (node-named) source model: the weights, once, and the verification reference
    segments/segK_T.onnx          each segment's graph, without weight data
    iree/segK_T/<target>/bN.vmfb  Track B modules (and Track A segments for llvm-cpu), weights externalized
    track_a/ptx/<arch>/*.ptx      hand-written kernels as PTX; track_a/cubin/<sm>/*.cubin assembled from them
    verify.json                   the build-time verification report

A bundle is written into a temporary sibling directory and renamed into place only once it is
complete and verified; `manifest.json` is written last and lists the SHA-256 of every other file,
so a truncated or edited bundle is refused at load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from dualtrack.compiler.partition import attach_initializers
from dualtrack.contract.manifest import Manifest, Target
from dualtrack.contract.plan import Plan, Segment
from dualtrack.errors import BundleError
from dualtrack.kernels import CONV3X3_WGMMA, KERNELS, ConvGeneralSpec, choose_conv3x3
from dualtrack.kernels.problems import conv_layers

MANIFEST = "manifest.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BundleWriter:
    """Collects files in a temporary directory next to the destination; `commit` renames it into place."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest.resolve()
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self._sweep_abandoned()
        # The writer's pid is in the name, so a later build can tell an abandoned directory (its
        # build was killed) from one another build is writing right now.
        self.tmp = self.dest.parent / f".{self.dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.files: dict[str, str] = {}

    def _sweep_abandoned(self) -> None:
        """Remove temporary siblings left by builds that were killed before they could clean up."""
        for kind in ("tmp", "old"):
            for path in self.dest.parent.glob(f".{self.dest.name}.{kind}-*"):
                pid = path.name.rsplit(f".{kind}-", 1)[1].split("-", 1)[0]
                if pid.isdigit() and _pid_alive(int(pid)):
                    continue
                shutil.rmtree(path, ignore_errors=True)

    def add(self, rel: str, data: bytes) -> Path:
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.files[rel] = sha256(data)
        return path

    def add_json(self, rel: str, obj: Any) -> Path:
        return self.add(rel, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def commit(self, manifest: Manifest) -> Path:
        """Write the manifest last (with every file's hash), then swap the directory into place."""
        manifest = manifest.with_files(self.files)
        (self.tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n")
        old = None
        if self.dest.exists():
            old = self.dest.parent / f".{self.dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(self.dest, old)
        os.replace(self.tmp, self.dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.dest

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


@dataclass
class Bundle:
    """A bundle opened for reading, its integrity checked."""

    root: Path
    manifest: Manifest

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
        # The modules were compiled from the model whose hash the build recorded: a model.onnx swapped in
        # (its entry in `files` patched to match) would run other weights through code built for these.
        if manifest.files.get("model.onnx") != manifest.model.sha256:
            raise BundleError(
                f"{root}: model.onnx is not the model its modules were built from (sha256 "
                f"{manifest.files.get('model.onnx', 'missing')[:12]}, built from {manifest.model.sha256[:12]}); "
                "rebuild the bundle"
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
    def model(self) -> onnx.ModelProto:
        return onnx.load(str(self.root / "model.onnx"))

    @cached_property
    def weights(self) -> dict[str, np.ndarray]:
        return {t.name: numpy_helper.to_array(t) for t in self.model.graph.initializer}

    def segment_model(self, seg: Segment) -> onnx.ModelProto:
        return attach_initializers(onnx.load(str(self.root / seg.onnx)), self.weights)

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

    def conv3x3_choices(self, target: Target) -> list[tuple[Any, Any]]:
        """Which kernel each Track A conv3x3 launch runs on a device of ``target`` (an entry of the
        manifest's ``targets``), as (``ConvLayer``, ``ConvChoice``) pairs in plan order: the wgmma
        kernel where the target's image has it and takes the shape (pointers assumed aligned, as
        planned buffers are), else the tuned or heuristic mma.sync entry. What did run on a device:
        the engine's ``backend.stats.conv3x3``. The general conv's 3x3 stride-1 calls that the wgmma
        kernel takes (``ConvGeneralSpec.call_choice``) are listed too; its other calls are not."""
        image = self.track_a.get("ptx", {}).get(target.track_a_ptx, {})
        off = None if CONV3X3_WGMMA.stem in image else f"not in the {target.track_a_ptx} PTX"
        tuned = self.tuned_calls(target.cc_tuple)
        general = KERNELS["conv"]
        assert isinstance(general, ConvGeneralSpec)
        out = []
        for layer in conv_layers(self.plan, ops=("conv3x3", "conv")):
            assert layer.call is not None
            if layer.call.op == "conv":
                choice = general.call_choice(layer.call, layer.problem, wgmma_off=off)
                if choice is not None:
                    out.append((layer, choice))
                continue
            entry = tuned.get(layer.node, {}).get(str(layer.batch))
            out.append((layer, choose_conv3x3(layer.problem, wgmma_off=off, tuned=entry)))
        return out

    def tuned_calls(self, cc: tuple[int, int]) -> dict[str, dict[str, str]]:
        """The tuned entry of each Track A conv layer (Conv node -> batch size -> entry) that the
        build chose for the target of compute capability ``cc``; empty where nothing was tuned."""
        tuned = self.track_a.get("tuned", {})
        for t in self.manifest.targets:
            if t.arch in tuned and t.cc_tuple == tuple(cc):
                return tuned[t.arch]["calls"]
        return {}
