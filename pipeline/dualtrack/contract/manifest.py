"""The bundle's manifest: what a build produced and what a runtime may rely on, typed and versioned.

Like :mod:`dualtrack.contract.plan`, frozen dataclasses with a JSON form are the one contract between the
build (which writes ``manifest.json`` through :meth:`Manifest.to_json`) and everything that reads a
bundle (which gets it through :class:`dualtrack.contract.bundle.Bundle`, parsed once by :meth:`Manifest.from_json`).
A manifest of another format is refused with the fix (rebuild), never half-read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dualtrack.contract.plan import Plan
from dualtrack.errors import BundleError

# 2: typed manifest (model integrity, cpu_batch, front-end record). Bundles of format 1 are rebuilt.
# 3: the weights in weights.bin (ONNX external data of model.onnx) with an index here; reference
#    cases (verify/cases.npz) for the runtime's first-load check. Bundles of format 2 are rebuilt.
# 4: the depthwise tiled entries take stride 2 with the same arguments (the launch ABI cannot tell): a
#    format-3 bundle's dwconv image would trap on the launches this version gives them.
# 5: a grouped conv may run as fewer, wider groups of block-diagonal weights (the `merge` attribute): a
#    format-4 runtime would read the merged call with ONNX's weights.
BUNDLE_FORMAT = 5


@dataclass(frozen=True)
class ModelInfo:
    """The model the bundle was built from, and what the front end made of it."""

    source: str  # the config's model path at build time
    source_sha256: str  # of that file
    # contract.bundle.model_digest of model.onnx and weights.bin: the graph and weights every module was built from
    sha256: str
    graph: str
    export_batch: int | None = None  # the batch the export fixed (None: symbolic)
    classes: tuple[str, ...] | None = None
    frontend: tuple[str, ...] = ()  # the front end's rewrites, one line each


@dataclass(frozen=True)
class Weight:
    """Where one initializer of model.onnx is in weights.bin: ``length`` bytes at ``offset`` (the
    ONNX external-data entry says the same), a little-endian ``dtype`` array of ``shape``."""

    dtype: str  # a numpy dtype name: "float16"
    shape: tuple[int, ...]
    offset: int
    length: int


@dataclass(frozen=True)
class Target:
    """One GPU target of the build, as :func:`dualtrack.contract.arch.resolve_targets` resolved it."""

    requested: str
    arch: str  # "sm_90a"
    cc: str  # "9.0"
    track_a_ptx: str  # "compute_90a"
    track_a_cubin: str  # "sm_90a"
    track_b_iree_target: str  # "sm_89"
    tma: bool = False
    notes: tuple[str, ...] = ()

    @property
    def cc_tuple(self) -> tuple[int, int]:
        major, minor = self.cc.split(".")
        return int(major), int(minor)


@dataclass(frozen=True)
class Verification:
    passed: bool
    device: str
    seed: int
    # The tolerance the build verified at (rel_l2, max_abs, mismatch): the config's, else the
    # precision's default as judged on the network (compiler/verify.judged_tolerance). None in
    # bundles built before it was recorded.
    tolerance: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Artifacts:
    """Where each compiled thing is in the bundle.

    ``iree``: segment -> IREE target ("cuda-sm_89", "llvm-cpu") -> batch -> path.
    ``track_a``: the Track A build stage's record (PTX and cubin per arch with ISA and minimum driver,
    the kernels, tuned entries); its shape is owned by that stage (``build.track_a_artifacts``).
    """

    iree: Mapping[str, Mapping[str, Mapping[str, str]]]
    iree_tuned_flags: Mapping[str, Any] = field(default_factory=dict)
    track_a: Mapping[str, Any] = field(default_factory=dict)
    # segment -> CUDA IREE target -> batch -> {"plan", "ptx": [...], "cubin": {arch: [...]}} or
    # {"refused": why}: the module's launch plan (launch_plan.py) that runtime/replay.py runs
    iree_replay: Mapping[str, Mapping[str, Mapping[str, Mapping[str, Any]]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Window:
    """Sliding-window inference for images larger than the largest compiled size (the config's
    ``window:``; runtime/tiling.py): windows of ``size`` (None: the largest compiled size), origins
    as MONAI's ``sliding_window_inference`` places them at ``overlap``, outputs blended with
    ``blend`` weights (``gaussian``: sigma ``sigma_scale`` x the window side; ``constant``),
    ``batch`` windows per engine run (None: the largest compiled batch size)."""

    size: tuple[int, int] | None = None
    overlap: float = 0.25
    blend: str = "gaussian"
    sigma_scale: float = 0.125
    batch: int | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Window:
        size = d.get("size")
        return cls(
            size=(int(size[0]), int(size[1])) if size else None,
            overlap=float(d.get("overlap", 0.25)),
            blend=str(d.get("blend", "gaussian")),
            sigma_scale=float(d.get("sigma_scale", 0.125)),
            batch=int(d["batch"]) if d.get("batch") else None,
        )


@dataclass(frozen=True)
class SizePlan:
    """One more input size the bundle was built for (config ``sizes``; contract/sizes.py): its own
    plan, modules and reference cases, the same weights (weights.bin, once). The manifest's own
    ``plan`` is the largest size's; a bundle without ``sizes`` has that one size only."""

    height: int
    width: int
    plan: Plan
    artifacts: Artifacts
    model: str  # bundle-relative path of this size's graph (its initializers are weights.bin's)
    cases: str  # its reference cases (contract/cases.py)
    verification: Verification | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "plan": self.plan.to_json()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SizePlan:
        ver = d.get("verification")
        return cls(
            height=int(d["height"]),
            width=int(d["width"]),
            plan=Plan.from_json(d["plan"]),
            artifacts=Artifacts(**d["artifacts"]),
            model=d["model"],
            cases=d["cases"],
            verification=Verification(**ver) if ver else None,
        )


@dataclass(frozen=True)
class Manifest:
    dualtrack_version: str
    build_key: str
    created: str
    model: ModelInfo
    config: Mapping[str, Any]  # the validated config, as BuildConfig.model_dump(mode="json")
    targets: tuple[Target, ...]
    plan: Plan
    artifacts: Artifacts
    tools: Mapping[str, str]
    cpu_batch: int  # the batch the llvm-cpu modules are compiled for (the CPU runs bigger ones row by row)
    min_driver: int | None = None
    cpu_target: str | None = None  # the llvm-cpu modules' --iree-llvmcpu-target-cpu (track_b.cpu_target resolved)
    notes: tuple[str, ...] = ()
    verification: Verification | None = None
    files: Mapping[str, str] = field(default_factory=dict)  # path -> SHA-256, every file but the manifest
    weights: Mapping[str, Weight] = field(default_factory=dict)  # initializer name -> its place in weights.bin
    # The tolerance the bundle is held to (rel_l2, max_abs, mismatch): the config's `verify.tolerance`,
    # else the precision's default as the build judged it on the network (compiler/verify.judged_tolerance),
    # also where no CPU verification ran. None in bundles built before it was recorded.
    tolerance: Mapping[str, float] | None = None
    window: Window | None = None  # sliding-window inference (the config's `window:`); None: off
    format: int = BUNDLE_FORMAT
    # The other input sizes (config `sizes`), smallest first; empty in a one-size bundle, and in every
    # bundle built before sizes existed (the key is then absent: such a manifest reads as before).
    sizes: tuple[SizePlan, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["plan"] = self.plan.to_json()
        if self.sizes:
            out["sizes"] = [s.to_json() for s in self.sizes]
        else:
            del out["sizes"]
        return out

    def with_files(self, files: Mapping[str, str]) -> Manifest:
        return replace(self, files=dict(sorted(files.items())))

    def with_verification(self, verification: Verification) -> Manifest:
        return replace(self, verification=verification)

    @classmethod
    def from_json(cls, d: Any, where: str) -> Manifest:
        """Parse a manifest; BundleError (with the fix: rebuild) for another format or a malformed one."""
        got = d.get("format") if isinstance(d, dict) else None
        if got != BUNDLE_FORMAT:
            raise BundleError(
                f"{where} is bundle format {got}, this dualtrack reads format {BUNDLE_FORMAT}; "
                "rebuild it with this version (`dualtrack build CONFIG -o BUNDLE`)"
            )
        try:
            ver = d.get("verification")
            return cls(
                dualtrack_version=d["dualtrack_version"],
                build_key=d["build_key"],
                created=d["created"],
                model=ModelInfo(
                    **{
                        **d["model"],
                        "classes": tuple(d["model"]["classes"]) if d["model"].get("classes") else None,
                        "frontend": tuple(d["model"].get("frontend", ())),
                    }
                ),
                config=d["config"],
                targets=tuple(Target(**{**t, "notes": tuple(t.get("notes", ()))}) for t in d["targets"]),
                plan=Plan.from_json(d["plan"]),
                artifacts=Artifacts(**d["artifacts"]),
                tools=d["tools"],
                cpu_batch=int(d["cpu_batch"]),
                min_driver=d.get("min_driver"),
                # Bundles built before it was recorded: their config's value (then never "auto").
                cpu_target=d.get("cpu_target", d["config"].get("track_b", {}).get("cpu_target")),
                notes=tuple(d.get("notes", ())),
                verification=Verification(**ver) if ver else None,
                files=d.get("files", {}),
                weights={
                    k: Weight(w["dtype"], tuple(w["shape"]), int(w["offset"]), int(w["length"]))
                    for k, w in d["weights"].items()
                },
                format=d["format"],
                tolerance=d.get("tolerance"),
                window=Window.from_json(d["window"]) if d.get("window") else None,  # absent before it existed
                sizes=tuple(SizePlan.from_json(s) for s in d.get("sizes", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(
                f"{where}: the manifest is malformed ({type(e).__name__}: {e}); rebuild the bundle"
            ) from None


__all__ = [
    "BUNDLE_FORMAT",
    "Artifacts",
    "Manifest",
    "ModelInfo",
    "SizePlan",
    "Target",
    "Verification",
    "Weight",
    "Window",
]
