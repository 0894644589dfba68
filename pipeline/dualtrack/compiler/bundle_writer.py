"""Writing a bundle (contract/bundle.py has the layout and the reader), and the ONNX views of one
that only build tools need: the whole model and each segment's model with its weights.

The model's initializers are stored once, as ONNX external data in ``weights.bin`` (64-byte aligned,
so the runtime maps them as arrays), and indexed in the manifest (``Manifest.weights``): the runtime
reads them with numpy, while ``onnx.load`` of ``model.onnx`` resolves the same file.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dualtrack.compiler.partition import attach_initializers
from dualtrack.contract.bundle import MANIFEST, MODEL, WEIGHTS, Bundle, sha256
from dualtrack.contract.manifest import Manifest, Weight
from dualtrack.contract.plan import Segment
from dualtrack.errors import ModelError

ALIGN = 64  # each tensor's offset in weights.bin: any dtype's alignment, and a cache line


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

    def add_model(self, model: onnx.ModelProto) -> dict[str, Weight]:
        """model.onnx with its initializers' data in weights.bin; the index the manifest records."""
        graph, weights, index = externalize(model)
        self.add(WEIGHTS, weights)
        self.add(MODEL, graph)
        return index

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


def externalize(model: onnx.ModelProto) -> tuple[bytes, bytes, dict[str, Weight]]:
    """(model.onnx, weights.bin, index): every initializer's raw little-endian bytes moved to
    weights.bin at a 64-byte aligned offset, referenced there as ONNX external data."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    blob = bytearray()
    index: dict[str, Weight] = {}
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == TensorProto.STRING:
            raise ModelError(f"initializer {t.name} holds strings; dualtrack compiles numeric weights only")
        raw = t if t.HasField("raw_data") else numpy_helper.from_array(numpy_helper.to_array(t), t.name)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        shape = tuple(int(d) for d in t.dims)
        if len(raw.raw_data) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ModelError(
                f"initializer {t.name}: {len(raw.raw_data)} bytes for {dtype.name}{list(shape)} "
                "(a packed sub-byte type?); dualtrack stores weights of whole-byte types only"
            )
        blob.extend(b"\0" * (-len(blob) % ALIGN))
        index[t.name] = Weight(dtype.name, shape, len(blob), len(raw.raw_data))
        blob.extend(raw.raw_data)
        ext = TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", WEIGHTS), ("offset", index[t.name].offset), ("length", len(raw.raw_data))):
            ext.external_data.add(key=key, value=str(value))
        out.graph.initializer[i].CopyFrom(ext)
    return out.SerializeToString(), bytes(blob), index


def load_model(bundle: Bundle) -> onnx.ModelProto:
    """The bundle's whole model, weights included (the verification reference)."""
    return onnx.load(str(bundle.root / bundle.model_file))  # an input size's own graph (Bundle.at_size)


def segment_model(bundle: Bundle, seg: Segment) -> onnx.ModelProto:
    """One segment's ONNX model with the weights its nodes use."""
    return attach_initializers(onnx.load(str(bundle.root / seg.onnx)), bundle.weights)


__all__ = ["BundleWriter", "externalize", "load_model", "segment_model"]
