"""The build config (`configs/*.yaml`): schema, loading, and translation of the seed's vocabulary.

Validation is pydantic's; this module adds what a user needs on top: YAML errors with line and
column, the line of the offending key for schema errors, the nearest valid key for a typo, and the
seed's spellings (`arch: sm_90`, `iree_flags: [--iree-cuda-arch=..., --iree-cuda-enable-tma]`)
translated into real settings with a note instead of being passed through to a tool that rejects
them (FACTS 1-2).
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dualtrack.contract import sizes as size_rule
from dualtrack.contract.checks import DEFAULT_TOLERANCES, Tolerance
from dualtrack.errors import ConfigError

FIXED_BATCH = "batch: fixed"  # the fix a dim-0 refusal names (BuildConfig.batch)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Strict):
    """The model input as the service feeds it (batch 1 shape; dim 0 is the batch)."""

    name: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: Literal["uint8", "float16", "float32"] | None = None


class Rules(_Strict):
    """Nodes matched by name prefix or by ONNX op type."""

    name_prefixes: tuple[str, ...] = ()
    op_types: tuple[str, ...] = ()


class PartitionConfig(_Strict):
    """Which nodes run on Track A (hand-written kernels) and which on Track B (IREE).

    ``mode: auto`` (the default, and what a config without a ``partition:`` section gets): every
    node a Track A kernel takes starts on Track A, then Track A islands whose estimated saving is
    less than the track switches they cost move to Track B, and the plan is IREE alone where the
    cost model predicts that faster (`dualtrack.compiler.partition.assign_tracks`); the rules only
    override it, node by node. ``mode: rules``: exactly the nodes the ``track_a`` rules match run on
    Track A, every other node on Track B. ``mode: iree`` (or ``partition: iree``): every node on
    Track B, IREE alone (the baseline the others are measured against). In every mode `track_b`
    rules win over `track_a` rules, so a broad Track A rule can have exceptions.
    """

    mode: Literal["auto", "rules", "iree"] = "auto"
    track_a: Rules = Rules()
    track_b: Rules = Rules()
    switch_cost_us: float | None = Field(
        None,
        ge=0,
        description=(
            "auto only: what one track switch costs per inference, in microseconds (default: "
            "dualtrack.compiler.cost.SWITCH_COST_US for the default runtime path, Track B replayed in one CUDA "
            "graph; 80 for a bundle served through the IREE runtime, FACTS 9)"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        """`partition: auto` is `partition: {mode: auto}` (likewise `rules` and `iree`)."""
        if isinstance(v, str):
            if v not in ("auto", "rules", "iree"):
                raise ValueError(
                    f"'{v}' is not a partition; write `partition: auto`, `partition: iree` or a mapping with "
                    "mode/track_a/track_b"
                )
            return {"mode": v}
        return v

    @model_validator(mode="after")
    def _auto_only(self) -> PartitionConfig:
        if self.switch_cost_us is not None and self.mode != "auto":
            raise ValueError("switch_cost_us only applies to `mode: auto`; add `mode: auto` or drop it")
        if self.mode == "iree" and (self.track_a.name_prefixes or self.track_a.op_types):
            raise ValueError("`mode: iree` runs every node on Track B; drop the track_a rules or use `mode: rules`")
        return self


class TrackBConfig(_Strict):
    """IREE options."""

    iree_target: str | None = Field(None, description="override the IREE CUDA target for every arch")
    flags: tuple[str, ...] = Field((), description="iree-compile flags for every target")
    cuda_flags: tuple[str, ...] = Field((), description="iree-compile flags for the CUDA targets only")
    cpu_flags: tuple[str, ...] = Field((), description="iree-compile flags for llvm-cpu only")
    cpu: bool = Field(True, description="also compile llvm-cpu modules (CPU runtime and verification)")
    nhwc: bool = Field(
        True,
        description=(
            "keep Track A's NHWC tensors NHWC inside Track B segments (dualtrack.compiler.layout): a 1x1 conv "
            "becomes a matmul, a softmax over channels a per-pixel one, and an element-wise segment "
            "with few channels runs on rows of 512 pixels; false compiles the graph as partitioned"
        ),
    )
    cpu_target: str = Field(
        "auto",
        description=(
            "--iree-llvmcpu-target-cpu: 'auto' (default) is the best x86-64 level of the building CPU "
            "(x86-64-v4 where it has AVX-512, else x86-64-v3 ...; dualtrack.hostcpu); x86-64-v3 runs on "
            "any AVX2 CPU but IREE 3.13's fp16 code there is about 7x slower than v4's; 'host' for "
            "this CPU only. A level the building CPU lacks is refused (the build verifies on it)"
        ),
    )

    @field_validator("flags", "cuda_flags", "cpu_flags")
    @classmethod
    def _dashes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for f in v:
            if not f.startswith("--"):
                raise ValueError(f"{f!r} is not an iree-compile flag (flags start with --, e.g. --iree-opt-level=O3)")
        return v


class VerifyConfig(_Strict):
    samples: int = Field(1, ge=1, le=16, description="fresh random inputs per check")
    seed: int | None = Field(None, description="fix the input seed (default: fresh every build)")
    tolerance: Tolerance | None = None


class Preprocess(_Strict):
    """What the model expects of an image. With it, the build puts the conversion in front of the
    model, so the bundle takes what `run` and `serve` feed: uint8 (N, H, W, 3) RGB pixels.

    The model sees ``(pixel / scale - mean) / std`` per channel, in ``color`` order and ``layout``.
    ``GRAY``: a one-channel model (a CT or MRI slice) reads the image's luma, ITU-R 601's
    ``0.299 R + 0.587 G + 0.114 B`` (Pillow's ``convert("L")`` without its rounding), so a grey PNG
    (which the bundle reads as R = G = B) reaches it as its own values.
    """

    layout: Literal["NCHW", "NHWC"] = Field("NCHW", description="the model input's layout (torch exports: NCHW)")
    color: Literal["RGB", "BGR", "GRAY"] = Field(
        "RGB", description="the channels the model reads: RGB, BGR, or GRAY (one channel: the luma)"
    )
    scale: float = Field(255.0, gt=0, description="pixels are divided by this first (255: to [0, 1])")
    mean: tuple[float, ...] = Field((0.0, 0.0, 0.0), description="per channel: 3 values (GRAY: 1), or 1 for all")
    std: tuple[float, ...] = Field((1.0, 1.0, 1.0), description="per channel: 3 values (GRAY: 1), or 1 for all")

    @field_validator("mean", "std")
    @classmethod
    def _one_or_three(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if len(v) not in (1, 3):
            raise ValueError(f"give 3 values (one a channel) or 1 (every channel), not {len(v)}: {list(v)}")
        return v

    @field_validator("std")
    @classmethod
    def _positive(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(x <= 0 for x in v):
            raise ValueError(f"std must be positive, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _gray_takes_one(self) -> Preprocess:
        if self.color == "GRAY":
            for key in ("mean", "std"):
                v = getattr(self, key)
                if len(set(v)) > 1:
                    raise ValueError(
                        f"color GRAY feeds one channel, so `{key}` takes one value, not {list(v)} "
                        f"(write `{key}: [{v[0]}]`)"
                    )
        return self

    @property
    def channels(self) -> int:
        """The channels the model reads: 1 for GRAY, else 3."""
        return 1 if self.color == "GRAY" else 3

    def per_channel(self, key: str) -> tuple[float, ...]:
        """``mean`` or ``std``, one value for each of :attr:`channels`."""
        v = getattr(self, key)
        return v[:1] if self.channels == 1 else (v if len(v) == 3 else v * 3)


class Postprocess(_Strict):
    """Which output holds the segmentation and what it holds. With it, the build appends the
    activation and the class choice, so the bundle outputs `mask` (uint8 class ids, N x H x W) and
    `probs` (float32, N x classes x H x W) like the reference model; other outputs are dropped."""

    output: str | None = Field(None, description="the logits tensor (default: the model's only 4-D float output)")
    activation: Literal["softmax", "sigmoid", "none"] = Field(
        "softmax",
        description=(
            "softmax over classes; sigmoid per class (one class: mask = p > 0.5); none: the output "
            "already holds probabilities"
        ),
    )
    classes: tuple[str, ...] | None = Field(None, description="class names, one per output channel")


class WindowConfig(_Strict):
    """Sliding-window inference (runtime/tiling.py) for an image larger than the largest compiled size:
    overlapping windows run through the engine in batches, their outputs blended and the mask answered
    at the image's own size. Window origins and weights are MONAI's ``sliding_window_inference``'s."""

    size: tuple[int, int] | None = Field(
        None, description="the window (height, width); default: the bundle's largest compiled input size"
    )
    overlap: float = Field(0.25, ge=0, lt=1, description="the fraction of a window its neighbour overlaps")
    blend: Literal["gaussian", "constant"] = Field(
        "gaussian", description="gaussian: weights fall off toward a window's edges (sigma 0.125 x its side); constant"
    )
    sigma_scale: float = Field(0.125, gt=0, description="gaussian only: sigma as a fraction of the window's side")
    batch: int | None = Field(None, ge=1, description="windows per engine run; default: the largest of batch_sizes")

    @field_validator("size")
    @classmethod
    def _positive_size(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and min(v) < 1:
            raise ValueError(f"window size must be two positive sides (height, width), got {list(v)}")
        return v


def _positive_size(v: tuple[int, int]) -> tuple[int, int]:
    if v[0] < 1 or v[1] < 1:
        raise ValueError(f"a size is [height, width] in pixels, both positive, not {list(v)}")
    return v


class SizeRange(_Strict):
    """``sizes: {min, opt, max}``: compiles min, opt, max and, between opt and max, each dim doubled
    from opt (x2, x4, ...) capped at max's (dualtrack.contract.sizes, the range rule)."""

    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]

    @model_validator(mode="after")
    def _ordered(self) -> SizeRange:
        for v in (self.min, self.opt, self.max):
            _positive_size(v)
        if not all(a <= b <= c for a, b, c in zip(self.min, self.opt, self.max, strict=True)):
            raise ValueError(
                f"min {list(self.min)} <= opt {list(self.opt)} <= max {list(self.max)} must hold in both dims"
            )
        return self


class CalibrationConfig(_Strict):
    """FP8 calibration and the per-layer choice (``precision: fp8``; compiler/fp8.py, docs/fp8.md)."""

    images: Path | None = Field(
        None,
        description=(
            "a folder of PNG/JPEG images (relative to this config) that calibrates and verifies the fp8 layers; "
            "default: `samples` random images drawn by the build (real images calibrate better)"
        ),
    )
    samples: int = Field(8, ge=2, le=256, description="random images drawn when `images` is unset")
    method: Literal["amax", "percentile"] = Field(
        "percentile", description="each activation's scale from its largest |value| (amax) or a percentile of them"
    )
    percentile: float = Field(99.99, gt=50, le=100, description="percentile only: the |value| percentile kept")
    held_out: float = Field(
        0.25, ge=0, lt=1, description="the share of the images kept out of calibration, verified on only"
    )
    threshold: float = Field(
        0.1,
        gt=0,
        description="a layer whose fp8 output is off its fp16 output by more than this relative L2 stays fp16",
    )
    fp16_layers: tuple[str, ...] | None = Field(
        None, description="conv node names kept fp16; default: the first and the last convolution"
    )
    agreement_floor: float = Field(
        99.5, gt=0, le=100, description="the % of mask pixels the fp8 plan must share with fp32 onnxruntime's"
    )
    seed: int = Field(0, description="the random images' seed (fixed: the calibration, hence the plan, reproduces)")

    @model_validator(mode="after")
    def _percentile_only(self) -> CalibrationConfig:
        if self.method == "amax" and "percentile" in self.model_fields_set:
            raise ValueError("`percentile` applies to `method: percentile`; drop it or set method: percentile")
        return self


class BuildConfig(_Strict):
    """A validated `configs/*.yaml`. Paths are resolved against the config file's folder."""

    model: Path
    precision: Literal["fp16", "fp32", "fp8"] | None = Field(
        None,
        description=(
            "the precision to run in; default: the model's own. fp16 on an fp32 model converts it "
            "(inputs and outputs stay fp32) and verifies it against the fp32 original; fp8 (sm_90a) is the fp16 "
            "network with its calibrated convolutions in e4m3 (`calibration:`, docs/fp8.md)"
        ),
    )
    calibration: CalibrationConfig | None = Field(
        None, description="fp8 only: the calibration images, statistic and per-layer fallback (docs/fp8.md)"
    )
    preprocess: Preprocess | None = None
    postprocess: Postprocess | None = None
    simplify: bool = Field(
        True,
        description=(
            "fold constants and shape computations and remove Identity nodes (onnxslim) where the "
            "graph has any; the build report lists what the front end rewrote"
        ),
    )
    input: InputSpec = InputSpec()
    batch: Literal["images", "fixed"] = Field(
        "images",
        description=(
            "images (default): dim 0 of the input and outputs is a batch of images, run image by image, "
            "any count; fixed: dim 0 is part of the model's shape (a reduction, softmax or concat over "
            "axis 0, operands with rows of their own): the exported input shape is built and run whole, "
            "every node on Track B, and the engine refuses any other shape"
        ),
    )
    batch_sizes: tuple[int, ...] = (1,)
    sizes: tuple[tuple[int, int], ...] | SizeRange | None = Field(
        None,
        description=(
            "the image sizes to compile, [height, width] each: a list ([[512, 512], [720, 1280]]) or a range "
            "{min: [h, w], opt: [h, w], max: [h, w]}, which compiles min, opt, max and, between opt and max, each "
            "dim doubled from opt (x2, x4, ...) capped at max's. Default: the export's size only. An image runs "
            "at the smallest size that holds it, padded at the bottom and right by its edge pixels, and its "
            "outputs are cropped back; one larger than every size is resized to the largest. Each size is a "
            "plan, IREE modules and a CPU verification of its own (build time grows with the count); the "
            "weights are stored once. Needs an (N, H, W, 3) uint8 image input (`preprocess`, or a model that takes one)"
        ),
    )
    targets: tuple[str, ...] = Field(
        ("sm_90a",), description="GPU architectures to build for; [] builds for the CPU only (IREE llvm-cpu)"
    )
    enable_tma: bool | None = Field(
        None,
        description=(
            "Track A's TMA kernels (the sm_90a TMA + wgmma conv3x3): unset, on for every target that has "
            "the bulk tensor copy engine; true, the same but an error when no target has it; false, off"
        ),
    )
    partition: PartitionConfig = PartitionConfig()
    tuning: Path | None = Field(
        None,
        description=(
            "a tuning file written by `dualtrack tune` (relative to this config): each Track A conv "
            "layer whose shape it has a record for, on a target of the same compute capability, "
            "launches the measured winner instead of the heuristic's tile; each Track B segment "
            "with a record for its graph, IREE target and batch is compiled with the winning flags"
        ),
    )
    track_b: TrackBConfig = TrackBConfig()
    verify: VerifyConfig = VerifyConfig()
    window: WindowConfig | None = Field(
        None, description="sliding-window inference for images larger than the largest compiled size (off: unset)"
    )
    output: Path | None = None
    notes: tuple[str, ...] = ()  # translations applied to seed vocabulary, filled by load_config

    @field_validator("batch_sizes")
    @classmethod
    def _batches(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(b < 1 for b in v):
            raise ValueError("batch_sizes must be positive integers, e.g. [1, 8]")
        return tuple(sorted(set(v)))

    @field_validator("sizes", mode="before")
    @classmethod
    def _range(cls, v: Any) -> Any:
        """A mapping is a range: its own error, not the list form's ("Input should be a valid tuple")."""
        if not isinstance(v, dict):
            return v
        try:
            return SizeRange.model_validate(v)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}") from None

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, v: tuple[tuple[int, int], ...] | SizeRange | None) -> Any:
        if isinstance(v, tuple):
            if not v:
                raise ValueError("sizes is empty; list [height, width] pairs or drop `sizes` for the export's size")
            for s in v:
                _positive_size(s)
        return v

    def compiled_sizes(self, export: tuple[int, int]) -> tuple[tuple[int, int], ...]:
        """The sizes the build compiles, in the order the engine tries them (contract/sizes.py);
        ``export`` is the export's own (height, width), the default."""
        if self.sizes is None:
            return (export,)
        if isinstance(self.sizes, SizeRange):
            return size_rule.range_sizes(self.sizes.min, self.sizes.opt, self.sizes.max)
        return size_rule.sorted_sizes(self.sizes)

    @model_validator(mode="after")
    def _fp8_only(self) -> BuildConfig:
        if self.calibration is not None and self.precision != "fp8":
            raise ValueError("`calibration:` applies to `precision: fp8`; set it or drop `calibration`")
        if self.precision == "fp8" and self.batch == "fixed":
            raise ValueError("`precision: fp8` quantizes Track A convolutions, which `batch: fixed` has none of")
        return self

    @model_validator(mode="after")
    def _sized_images(self) -> BuildConfig:
        if self.sizes is not None and self.batch == "fixed":  # an image input: checked on the model (spatial.py)
            raise ValueError("`sizes` compiles an image model at several sizes: use `batch: images` or drop `sizes`")
        return self

    @model_validator(mode="after")
    def _fixed_shape(self) -> BuildConfig:
        """`batch: fixed` builds the export's one shape, with no image wrap and no Track A kernels."""
        if self.batch != "fixed":
            return self
        if "batch_sizes" in self.model_fields_set:
            raise ValueError("`batch: fixed` builds the exported input shape whole; drop `batch_sizes`")
        if self.preprocess is not None or self.postprocess is not None:
            raise ValueError(
                "`batch: fixed` builds a model on its own tensors; drop `preprocess`/`postprocess` (they serve "
                "batches of images: use `batch: images`)"
            )
        if self.partition.mode == "rules" or self.partition.track_a.op_types or self.partition.track_a.name_prefixes:
            raise ValueError(
                "`batch: fixed` runs every node on Track B (Track A kernels compute image by image); "
                "drop the partition's track_a rules"
            )
        return self

    @model_validator(mode="after")
    def _window(self) -> BuildConfig:
        """Windows blend the model's probabilities at compiled batch sizes: postprocess and a batch it has."""
        if self.window is None:
            return self
        if self.postprocess is None:
            raise ValueError(
                "`window:` blends the bundle's probabilities; add `postprocess:` (e.g. activation: softmax)"
            )
        if self.window.batch is not None and self.window.batch not in self.batch_sizes:
            raise ValueError(
                f"window.batch {self.window.batch} is not one of batch_sizes {list(self.batch_sizes)}; "
                "add it to batch_sizes or drop window.batch (default: the largest)"
            )
        return self

    def tolerance(self) -> Tolerance:
        """The verification tolerance: the config's, else the default of the precision (fp32 until the
        front end has read the model's; fp8's is its fp16 network's until its build measures the fp8 one)."""
        precision = "fp16" if self.precision == "fp8" else self.precision
        return self.verify.tolerance or DEFAULT_TOLERANCES[precision or "fp32"]


# Seed spellings: key -> (where it goes, why).
_SEED_KEYS = {"arch": "targets", "archs": "targets", "iree_flags": "track_b.flags", "tma": "enable_tma"}
_DROPPED_IREE_FLAGS = {
    "--iree-cuda-enable-tma": "IREE 3.13 has no TMA option; TMA is a Track A feature (enable_tma)",
}


def _as_list(key: str, value: Any, path: Path) -> list[str]:
    """A seed key that takes one string or a list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"{path}: `{key}` must be a string or a list of strings, not {value!r}")


def _translate_seed(raw: dict[str, Any], notes: list[str], path: Path) -> dict[str, Any]:
    """Rewrite the seed's vocabulary into this schema, recording each translation."""
    raw = dict(raw)
    for key in ("targets", "track_b"):
        if (
            key in raw
            and not isinstance(raw[key], list if key == "targets" else dict)
            and (key == "track_b" or not isinstance(raw[key], str))
        ):
            return raw  # let the schema report the wrong type with its line
    for old, new in _SEED_KEYS.items():
        if old not in raw:
            continue
        value = raw.pop(old)
        if new == "targets":
            raw["targets"] = list(raw.get("targets", [])) + _as_list(old, value, path)
        elif new == "track_b.flags":
            tb = dict(raw.get("track_b") or {})
            tb["flags"] = list(tb.get("flags", [])) + _as_list(old, value, path)
            raw["track_b"] = tb
        else:
            raw[new] = value
        notes.append(f"`{old}` is read as `{new}`")
    tb = raw.get("track_b")
    if isinstance(tb, dict) and tb.get("flags"):
        kept = []
        for flag in tb["flags"]:
            name, _, val = str(flag).partition("=")
            if name == "--iree-cuda-arch":
                # FACTS 2: the flag does not exist; the arch becomes a target and the resolver maps it.
                raw["targets"] = [*list(raw.get("targets", [])), val]
                notes.append(f"`{flag}` does not exist in IREE 3.13; {val} added to `targets` and resolved")
            elif name == "--iree-cuda-target":
                tb = {**tb, "iree_target": val}
                notes.append(f"`{flag}` moved to `track_b.iree_target`")
            elif name in _DROPPED_IREE_FLAGS:
                notes.append(f"`{flag}` dropped: {_DROPPED_IREE_FLAGS[name]}")
                if name == "--iree-cuda-enable-tma":
                    raw["enable_tma"] = True
            else:
                kept.append(flag)
        raw["track_b"] = {**tb, "flags": kept}
    return raw


def _key_line(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML key at `loc` (a pydantic error location), if it can be found."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == part:
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = BuildConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        candidates = [ann, *typing.get_args(ann)]  # Tolerance | None -> Tolerance
        found = [a for a in candidates if isinstance(a, type) and (issubclass(a, BaseModel) or is_dataclass(a))]
        if not found:
            return []
        if not issubclass(found[0], BaseModel):  # a contract dataclass (Tolerance): a leaf
            return [f.name for f in fields(found[0])]
        model = found[0]
    return list(model.model_fields)


def _format(err: dict[str, Any], path: Path, root: yaml.Node | None) -> str:
    loc = tuple(err["loc"])
    dotted = ".".join(str(p) for p in loc)
    line = _key_line(root, loc)
    where = f"{path}:{line}" if line else str(path)
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's, a dataclass's
        near = difflib.get_close_matches(str(loc[-1]), _fields_at(loc), n=1)
        hint = f"; did you mean `{near[0]}`?" if near else f"; valid keys here: {', '.join(_fields_at(loc))}"
        return f"{where}: unknown key `{dotted}`{hint}"
    # A whole-config validator's error has no key to name.
    return f"{where}: `{dotted}`: {err['msg']}" if dotted else f"{where}: {err['msg']}"


def load_config(path: str | Path) -> BuildConfig:
    """Read, translate and validate a build config. Raises ConfigError with one line naming the fix."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} not found; pass the path of a YAML config such as configs/unet.yaml"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        pos = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{pos}: invalid YAML: {e.problem or e.context}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping (key: value lines), not {type(raw).__name__}")
    notes: list[str] = []
    raw = _translate_seed(raw, notes, path)
    try:
        cfg = BuildConfig.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ConfigError(_format(first, path, root) + more) from None
    base = path.parent
    model = cfg.model if cfg.model.is_absolute() else (base / cfg.model)
    output = cfg.output if cfg.output is None or cfg.output.is_absolute() else (base / cfg.output).resolve()
    tuning = cfg.tuning
    if tuning is not None and not tuning.is_absolute():
        tuning = (base / tuning).resolve()
    cal = cfg.calibration
    if cal is not None and cal.images is not None and not cal.images.is_absolute():
        cal = cal.model_copy(update={"images": (base / cal.images).resolve()})
    return cfg.model_copy(
        update={
            "model": model.resolve(),
            "output": output,
            "tuning": tuning,
            "calibration": cal,
            "notes": tuple(notes),
        }
    )
