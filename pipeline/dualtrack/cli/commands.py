"""The `dualtrack` command: a thin click layer over the Python API.

Every DualtrackError becomes one line on stderr and its documented exit code (README "Exit codes");
`--verbose` adds the error's detail (tool stderr, JIT log, verification table).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from dualtrack import atomic
from dualtrack.contract.sizes import label
from dualtrack.errors import EXIT_CODES, DualtrackError, InputError

if TYPE_CHECKING:
    from dualtrack.contract.bundle import Bundle
    from dualtrack.runtime.engine import Engine


class _Output:
    """Progress with rich on a terminal, plain lines otherwise; nothing but JSON with --json."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        if self.tty and not quiet:
            from rich.console import Console

            self.console = Console(stderr=True)

    def step(self, msg: str) -> None:
        if self.quiet:
            return
        if self.tty:
            self.console.print(f"[bold cyan]»[/] {msg}", highlight=False)
        else:
            click.echo(f"- {msg}", err=True)


def _fail(e: DualtrackError, verbose: bool) -> None:
    click.echo(f"error: {e.message}", err=True)
    if verbose and e.detail:
        click.echo(e.detail, err=True)
    sys.exit(e.exit_code)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DualtrackError as e:
            _fail(e, bool(ctx.params.get("verbose")))


@click.group(cls=_Group, epilog="Exit codes: " + "; ".join(f"{k} {v}" for k, v in sorted(EXIT_CODES.items())))
@click.option("-v", "--verbose", is_flag=True, help="Print the detail behind an error (tool stderr, JIT log).")
@click.version_option(package_name="dualtrack")
def main(verbose: bool) -> None:
    """Compile one segmentation model along two tracks and run it from one CUDA context."""


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), help="Bundle directory (default: `output:` in the config)."
)
@click.option("--force", is_flag=True, help="Rebuild and re-verify even when the bundle is up to date.")
@click.option(
    "--tuning",
    type=click.Path(path_type=Path),
    help="Tuning file from `dualtrack tune` (overrides `tuning` in the config).",
)
@click.option(
    "--cpu-only", is_flag=True, help="Build IREE llvm-cpu modules only (no GPU code), whatever `targets` says."
)
@click.option("--json", "as_json", is_flag=True, help="Print the build result as JSON on stdout.")
def build(config: Path, output: Path | None, force: bool, tuning: Path | None, cpu_only: bool, as_json: bool) -> None:
    """Build, verify and write the bundle for CONFIG."""
    from dualtrack.compiler.build import build as run_build

    out = _Output(as_json)
    result = run_build(config, output, force=force, progress=out.step, tuning=tuning, cpu_only=cpu_only)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    for note in result.notes:
        out.step(f"note: {note}")
    if result.up_to_date:
        click.echo(
            f"{result.bundle}: up to date, nothing compiled ({result.cached} modules unchanged) "
            f"in {result.seconds:.1f} s"
        )
    else:
        click.echo(
            f"{result.bundle}: built in {result.seconds:.1f} s "
            f"({result.compiled} modules compiled, {result.cached} from cache); "
            f"verification {'passed' if result.verification and result.verification['passed'] else 'not run'}"
        )


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Tuning file to merge the results into (default: `tuning` of CONFIG, else ./tuning.json).",
)
@click.option("--batch", "batches", type=int, multiple=True, help="Batch size to tune (repeatable; default: CONFIG's).")
@click.option("--layers", help="Only the Conv nodes whose name matches this glob, e.g. 'enc*'.")
@click.option("--max-configs", type=int, help="Try at most N tiles (the kernel's fixed variants first).")
@click.option("--iters", type=int, default=20, show_default=True, help="Timed launches per candidate (median kept).")
@click.option("--device-index", type=int, default=0, show_default=True)
@click.option(
    "--track-b",
    is_flag=True,
    help="Search IREE flags for the Track B segments instead (CONFIG may then be a kit folder).",
)
@click.option(
    "--prepare-kit",
    type=click.Path(path_type=Path),
    help="With --track-b: only compile the candidates into this kit folder (needs iree-compile, no GPU); "
    "time it on the GPU machine with `dualtrack tune KIT --track-b`.",
)
@click.option("--arch", "target", help="With --track-b: the GPU arch to compile for (default: CONFIG's first target).")
@click.option("--candidates", help="With --track-b: comma-separated IREE flag candidates (default: all; see docs).")
def tune(
    config: Path,
    output: Path | None,
    batches: tuple[int, ...],
    layers: str | None,
    max_configs: int | None,
    iters: int,
    device_index: int,
    track_b: bool,
    prepare_kit: Path | None,
    target: str | None,
    candidates: str | None,
) -> None:
    """Search the Track A conv kernel's tiles for every layer of CONFIG (a build config or a bundle)
    on this GPU: each candidate is verified against the numpy reference before it is timed, and
    the winners are merged into a tuning file that `dualtrack build --tuning` reads.

    With --track-b: the same for IREE flags of every Track B segment, verified against onnxruntime."""
    if track_b or prepare_kit is not None or target or candidates:
        if not track_b:
            raise click.UsageError("--prepare-kit, --arch and --candidates go with --track-b")
        _tune_track_b(config, output, prepare_kit, target, candidates, iters, device_index)
        return
    from dualtrack.tuning import TuneOptions, tune_track_a

    opts = TuneOptions(batches=batches, layers=layers, max_configs=max_configs, iters=iters, device_index=device_index)
    out = _Output(False)
    with _problem_bar(out) as on_problem:
        result = tune_track_a(config, output, opts, progress=out.step, on_problem=on_problem)
    for r in result.records:
        layers_ = ", ".join(r.layers[:3]) + (f" (+{len(r.layers) - 3})" if len(r.layers) > 3 else "")
        used = "" if r.beats_baseline else "  (baseline kept)"
        click.echo(
            f"{r.problem.label():<34} {r.baseline_ms:8.4f} -> {r.time_ms:8.4f} ms  {r.speedup:5.2f}x  "
            f"{r.entry.removeprefix('conv3x3_nhwc_')}{used}  [{layers_}]"
        )
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in result.phases.items())
    click.echo(
        f"{result.output}: {len(result.records)} problems tuned on {result.gpu} ({result.arch}), "
        f"{result.candidates} tiles, in {result.seconds:.1f} s ({phases})"
    )


def _tune_track_b(
    source: Path,
    output: Path | None,
    prepare_kit: Path | None,
    target: str | None,
    candidates: str | None,
    iters: int,
    device_index: int,
) -> None:
    from dualtrack.tuning.iree_flags import tune_track_b

    out = _Output(False)
    only = [c.strip() for c in candidates.split(",") if c.strip()] if candidates else None
    res = tune_track_b(
        source,
        output,
        prepare_only=prepare_kit,
        target=target,
        only=only,
        iters=iters,
        device_index=device_index,
        say=out.step,
    )
    if res.output is None:
        n = sum(len(per) for s in res.kit.segments for per in s.modules.values())
        click.echo(
            f"{res.kit.root}: {n} modules ({len(res.kit.segments)} segments x {len(res.kit.candidates)} candidates "
            f"x batches {list(res.kit.batch_sizes)}) for {res.kit.iree_target}; "
            f"time them on the GPU with `dualtrack tune {res.kit.root} --track-b -o tuning.json`"
        )
        return
    for r in res.results:
        win, base = r.winner, r.baseline
        rejected = [c.name for c in r.results if not c.passed]
        line = f"{r.segment} N={r.batch}: "
        if win is None:
            line += "no candidate passed verification"
        else:
            line += f"{win.name} {win.time_ms:.3f} ms"
            if base is not None and base.time_ms:
                line += f" (config's flags {base.time_ms:.3f} ms, {base.time_ms / win.time_ms:.2f}x)"
        if rejected:
            line += f"; rejected: {', '.join(rejected)}"
        click.echo(line)
    click.echo(f"{res.output}: {len(res.results)} Track B records on {res.gpu['gpu']}, in {res.seconds:.1f} s")


@contextlib.contextmanager
def _problem_bar(out: _Output) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar over the problems on a terminal; plain step lines otherwise."""
    if not out.tty or out.quiet:
        yield lambda done, total, what: out.step(f"[{done}/{total}] {what}")
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=out.console
    ) as bar:
        task = bar.add_task("tune", total=None)

        def update(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        yield update


# Class 0 black, then well-separated colours (the Pascal VOC convention), 256 entries.
_PALETTE = [
    channel
    for i in range(256)
    for channel in (
        sum(((i >> (3 * j)) & 1) << (7 - j) for j in range(3)),
        sum(((i >> (3 * j + 1)) & 1) << (7 - j) for j in range(3)),
        sum(((i >> (3 * j + 2)) & 1) << (7 - j) for j in range(3)),
    )
]


def _read_image(
    path: Path, shape: tuple[int, ...], sizes: tuple[tuple[int, int], ...] = (), window: bool = False
) -> tuple[np.ndarray, tuple[int, int]]:
    """IMAGE at the model's ``(n, H, W, 3)`` input size (at its own, where a compiled size of
    ``sizes`` holds it) and its displayed ``(width, height)``, by the rules the service follows
    (dualtrack.imaging)."""
    from dualtrack.imaging import load_for_model

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"image {path} not found") from None
    except IsADirectoryError:
        raise InputError(f"image {path} is a folder; pass an image file") from None
    except OSError as e:
        raise InputError(f"cannot read image {path} ({e.strerror or e}); check that it is readable") from None
    picture = load_for_model(data, shape[1], shape[2], sizes=sizes, window=window, name=str(path))
    return picture.pixels[None], picture.size


def _check_output(output: Path) -> None:
    """Refuse an -o that cannot be written, before the engine is loaded (no folder is created for it)."""
    if output.is_dir():
        raise InputError(f"-o {output} is a folder; pass a file path such as {output / 'mask.png'}")
    folder = output.parent
    if not folder.is_dir():
        state = "is a file" if folder.exists() else "does not exist"
        raise InputError(f"-o {output}: folder {folder} {state}; create the folder first (mkdir -p {folder})")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("image", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Where to write the mask PNG.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--device-index", type=int, default=0, show_default=True)
def run(bundle: Path, image: Path, output: Path, device: str, device_index: int) -> None:
    """Segment IMAGE with BUNDLE; write the mask as a palette PNG (pixel value = class id) at the image's size.

    IMAGE is read as the service reads it (dualtrack.imaging): PNG or JPEG, one frame, at most 64
    megapixels, EXIF orientation applied, 16-bit and palette images scaled to 8-bit RGB."""
    from PIL import Image

    from dualtrack.imaging import check_image_model, mask_to_size
    from dualtrack.runtime.engine import Engine

    _check_output(output)
    with Engine.load(bundle, device, device_index) as engine:
        check_image_model(engine.input_spec, engine.output_specs, str(bundle))
        window = engine.bundle.manifest.window is not None
        # The size as displayed; at it, where the bundle has several sizes and one holds it (contract/sizes.py).
        x, (width, height) = _read_image(image, engine.input_spec.shape, engine.sizes, window)
        result = engine.run(x)
        # A palette PNG: pixel values are the class ids, and viewers show each class in its own colour.
        mask = Image.fromarray(mask_to_size(result["mask"][0].astype(np.uint8), height, width), mode="P")
        mask.putpalette(_PALETTE)
        png = io.BytesIO()
        mask.save(png, format="PNG")
        try:
            atomic.write_bytes(output, png.getvalue())  # the mask appears whole or not at all
        except OSError as e:
            raise InputError(f"cannot write {output} ({e.strerror or e}); pass -o a path you can write to") from None
        counts = np.bincount(
            result["mask"].ravel(),
            minlength=engine.output_specs[-1].shape[1] if len(engine.output_specs[-1].shape) == 4 else 0,
        )
        t = engine.last_timings
        click.echo(
            f"{output}: mask {mask.size[0]}x{mask.size[1]}{_ran_at(engine, x)}, class pixels {counts.tolist()}, "
            f"{t['total_ms']:.1f} ms on {device} "
            + (
                f"(one CUDA graph, {t['graph_ms']:.2f} ms on the GPU)"
                if t.get("graph_ms")
                else f"(track A {t['track_a_ms']:.1f} ms, track B {t['track_b_ms']:.1f} ms)"
            )
        )


def _ran_at(engine: Engine, x: np.ndarray) -> str:
    """How an image of a bundle of several sizes ran: at which compiled size, padded or not."""
    choice = engine.last_size
    if not engine.sizes or choice is None or choice.image != tuple(x.shape[1:3]):
        return f" (model input {label(engine.input_spec.shape[1:3])})" if engine.sizes else ""
    window = engine.bundle.manifest.window
    if engine.last_windows and window is not None:  # larger than every size: the sliding window (runtime/tiling.py)
        return f" ({engine.last_windows} windows of {label(window.size or choice.size)})"
    return f" (run at {label(choice.size)}{', padded and cropped back' if choice.padded else ''})"


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--device-index", type=int, default=0, show_default=True)
@click.option("--samples", type=int, default=1, show_default=True, help="Fresh random inputs per check.")
@click.option("--seed", type=int, default=None, help="Fix the random inputs (default: fresh).")
@click.option("--json", "as_json", is_flag=True)
def verify(bundle: Path, device: str, device_index: int, samples: int, seed: int | None, as_json: bool) -> None:
    """Check every segment and the whole plan of BUNDLE against onnxruntime (every input size's plan,
    in a bundle built with `sizes`)."""
    from dualtrack.compiler.verify import verify_engine
    from dualtrack.runtime.engine import Engine

    out = _Output(as_json)
    reports = {}
    with Engine.load(bundle, device, device_index) as engine:
        for e in [engine.at_size(s) for s in engine.sizes] or [engine]:
            if engine.sizes:
                out.step(f"size {label(e.input_spec.shape[1:3])}")
            tol = e.bundle.tolerance()
            reports[label(e.input_spec.shape[1:3])] = verify_engine(
                e, samples=samples, seed=seed, tol=tol, progress=out.step
            )
    if as_json:  # one size: the report as before; several: one per size
        one = len(reports) == 1
        click.echo(
            json.dumps(
                next(iter(reports.values())).to_json() if one else {k: r.to_json() for k, r in reports.items()},
                indent=2,
            )
        )
    else:
        for size, report in reports.items():
            for line in report.lines():
                click.echo(line if len(reports) == 1 else f"{size}: {line}")
    for report in reports.values():
        report.raise_if_failed()
    if not as_json:
        n = sum(len(r.checks) for r in reports.values())
        seeds = sorted({r.seed for r in reports.values()})
        click.echo(f"all {n} checks passed on {device} (seed {', '.join(map(str, seeds))})")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def info(bundle: Path, as_json: bool) -> None:
    """Describe BUNDLE: model, plan, targets, artifacts and tools."""
    from dualtrack.contract.bundle import Bundle

    b = Bundle.open(bundle)
    if as_json:
        from dualtrack.contract.precision import PrecisionRecord

        out = {k: v for k, v in b.manifest.to_json().items() if k != "files"}
        if (record := PrecisionRecord.read(b.root)) is not None:  # precision: fp8, each layer's choice
            out["precision_record"] = record.to_json()
        click.echo(json.dumps(out, indent=2))
        return
    for section in (
        _info_model,
        _info_plan,
        _info_precision,
        _info_track_a,
        _info_tuned_tiles,
        _info_targets,
        _info_checks,
    ):
        section(b)


def _info_precision(b: Bundle) -> None:
    """`precision: fp8`: each convolution's precision and why, and the mask agreement it was verified at."""
    from dualtrack.contract.precision import PrecisionRecord

    record = PrecisionRecord.read(b.root)
    for line in record.lines() if record is not None else ():
        click.echo(f"fp8        {line}")


def _info_model(b: Bundle) -> None:
    """What was built from what, and for which GPUs."""
    m = b.manifest
    click.echo(f"bundle     {b.root}  (format {m.format}, dualtrack {m.dualtrack_version}, built {m.created})")
    click.echo(f"model      {m.model.source}  sha256 {m.model.source_sha256[:16]}")
    asked = " (the config's fp8: the `fp8` lines below)" if m.config.get("precision") == "fp8" else ""
    click.echo(f"precision  {b.plan.precision}{asked}; batch sizes {list(b.plan.batch_sizes)}")
    if m.sizes:  # a bundle of several input sizes (config `sizes`): one plan each, the weights shared
        largest = label(b.sizes[-1])
        click.echo(
            f"sizes      {', '.join(label(s) for s in b.sizes)}: an image runs at the smallest that holds it, padded "
            f"by its edge and cropped back; a larger one is resized to {largest}"
            + (" (or windowed: `window`)" if m.window is not None else "")
        )
        for s in m.sizes:
            segs = ", ".join(f"{g.name}" for g in s.plan.segments)
            click.echo(f"size       {s.height}x{s.width}: {len(s.plan.segments)} segments ({segs})")
    if m.window is not None:  # sliding-window inference for larger images (runtime/tiling.py)
        w = m.window
        size = label(w.size or b.sizes[-1])
        click.echo(
            f"window     {size} windows, overlap {w.overlap}, {w.blend} blend, {w.batch} a run: an image larger "
            "than every size is tiled, its mask at its own size"
        )
    for rewrite in m.model.frontend:
        click.echo(f"front end  {rewrite}")
    if m.model.classes:
        click.echo(f"classes    {', '.join(m.model.classes)}")
    if not m.targets:
        click.echo("target     none: CPU only (IREE llvm-cpu)")
    for t in m.targets:
        click.echo(
            f"target     {t.arch} (cc {t.cc}): Track A {t.track_a_ptx} -> {t.track_a_cubin} cubin; "
            f"Track B IREE {t.track_b_iree_target}"
        )


def _info_plan(b: Bundle) -> None:
    """The segments, why the partition is what it is, and how each Track B module runs."""
    m = b.manifest
    for line in b.plan.summary():
        click.echo(f"segment    {line}")
    for line in b.plan.notes:  # how the partition was chosen, and why each node runs where it does
        click.echo(f"partition  {line}")
    for seg_name, per_target in sorted(m.artifacts.iree_replay.items()):
        for target, per_batch in sorted(per_target.items()):
            paths = []
            for batch, e in sorted(per_batch.items(), key=lambda kv: int(kv[0])):
                if "refused" in e:
                    paths.append(f"N={batch}: IREE runtime ({e['refused']})")
                else:
                    paths.append(f"N={batch}: replayed on the engine's stream")
            click.echo(f"track B    {seg_name} {target}: {'; '.join(paths)}")
    if any(s.track == "B" for s in b.plan.segments) and not m.artifacts.iree_replay and m.targets:
        click.echo("track B    no launch plans (built before replay existed): the IREE runtime runs it; rebuild")


def _info_track_a(b: Bundle) -> None:
    """Track A's PTX per arch, the grouped convs that run merged, and which kernel each 3x3 convolution
    launches."""
    from dualtrack.kernels import planned_conv_choices

    ptx = b.manifest.artifacts.track_a.get("ptx", {})
    for a, entries in sorted(ptx.items()):
        isas = {k["isa"] for k in entries.values()}
        click.echo(f"ptx        {a}: {', '.join(sorted(entries))} (ISA {', '.join(sorted(isas))})")
    merged = [c for s in b.plan.segments for c in s.calls if c.op == "conv" and (c.attr("merge") or 1) > 1]
    if merged:
        click.echo(
            f"grouped    {len(merged)} grouped conv(s) run as fewer groups of block-diagonal weights "
            "(ConvGeneralSpec.merged):"
        )
        for c in merged:
            g, m = c.attr("groups"), c.attr("merge")
            click.echo(f"             {c.nodes[0]}: {g * m} groups as {g} of {m}")
    for t in b.manifest.targets:
        choices = planned_conv_choices(b, t)
        wgmma = [(layer, c) for layer, c in choices if c.impl == "wgmma"]
        if not wgmma:
            continue
        rest = " and ".join(sorted({c.impl for _, c in choices if c.impl != "wgmma"})) or "mma.sync"
        click.echo(
            f"conv3x3    {t.arch}: {len(wgmma)} of {len(choices)} launches on the wgmma kernel, the rest "
            f"on {rest} (DUALTRACK_WGMMA=0: those on mma.sync too)"
        )
        per_node: dict[str, dict[int, str]] = {}
        for layer, c in choices:
            short = c.entry.removeprefix("conv3x3_wgmma_").removeprefix("conv3x3_nhwc_")
            what = short if c.impl == "wgmma" else f"{c.impl} {short} ({c.reason})"
            per_node.setdefault(layer.node, {})[layer.batch] = what
        for node, per in per_node.items():
            picks = ", ".join(f"N={n}: {w}" for n, w in per.items()) if len(set(per.values())) > 1 else per[min(per)]
            click.echo(f"             {node}: {picks}")


def _info_tuned_tiles(b: Bundle) -> None:
    """The Track A launches a tuning file moved off the heuristic's tiles."""
    for a, t in sorted(b.manifest.artifacts.track_a.get("tuned", {}).items()):
        calls, on = t["calls"], ", ".join(t["tuned_on"])
        if not calls:
            click.echo(f"tuned      {a}: {t['records']} records (tuned on {on}), none faster than the heuristic")
            continue
        n = sum(len(per) for per in calls.values())
        click.echo(
            f"tuned      {a}: {n} conv launches ({len(calls)} layers) on tuned tiles, "
            f"{len(t['entries'])} extra entries; tuned on {on}"
        )
        for node, per in sorted(calls.items()):
            picks = ", ".join(
                f"N={batch}: {e.removeprefix('conv3x3_nhwc_')}"
                for batch, e in sorted(per.items(), key=lambda kv: int(kv[0]))
            )
            click.echo(f"             {node}: {picks}")


def _info_targets(b: Bundle) -> None:
    """What the bundle needs of the machine that runs it, and the IREE flags tuning chose."""
    m = b.manifest
    if m.min_driver:
        from dualtrack.contract.arch import driver_str

        click.echo(f"driver     needs CUDA {driver_str(m.min_driver)} or newer for the PTX")
    click.echo(f"iree       targets {', '.join(b.iree_targets)}")
    if m.cpu_target is not None:  # what the CPU modules need of the CPU that runs them
        click.echo(f"cpu        llvm-cpu modules for {m.cpu_target} (batch {m.cpu_batch})")
    for seg, per_target in sorted(m.artifacts.iree_tuned_flags.items()):
        for target, per_batch in sorted(per_target.items()):
            for batch, r in sorted(per_batch.items(), key=lambda kv: int(kv[0])):
                gain = f", {r['speedup']:.2f}x the config's flags" if r.get("speedup") else ""
                click.echo(
                    f"tuned      {seg} {target} N={batch}: {r['candidate']} ({' '.join(r['flags']) or 'no flags'}); "
                    f"tuned on {r['gpu']}{gain}"
                )


def _info_checks(b: Bundle) -> None:
    """The build's verification and its notes."""
    ver = b.manifest.verification
    click.echo(
        f"verified   {'passed' if ver and ver.passed else 'no'} on {ver.device if ver else '-'} "
        f"(seed {ver.seed if ver else '-'})"
    )
    for n in b.manifest.notes:
        click.echo(f"note       {n}")


@main.command()
@click.option(
    "--bundle", type=click.Path(path_type=Path), help="Also say whether this bundle's Track A code can load here."
)
@click.option("--json", "as_json", is_flag=True)
def doctor(bundle: Path | None, as_json: bool) -> None:
    """Report the GPU and driver, the compilers found, and what IREE can target."""
    from dualtrack.cli.doctor import diagnose

    report = diagnose(bundle)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        click.echo(f"{key:<22} {value}")


@main.command("make-reference")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("models"), show_default=True)
@click.option("--base", type=int, default=32, show_default=True)
@click.option("--depth", type=int, default=4, show_default=True)
@click.option("--size", type=int, default=512, show_default=True, help="Height and width.")
def make_reference(output: Path, base: int, depth: int, size: int) -> None:
    """Write the reference U-Net (fp16 and fp32 ONNX) and a sample image."""
    from dualtrack.compiler.reference import UNetSpec, parameter_count, write_reference

    written = write_reference(output, UNetSpec(base=base, depth=depth, height=size, width=size))
    import onnx

    params = parameter_count(onnx.load(str(written["fp16"])))
    for k, p in written.items():
        click.echo(f"{p}  ({k})")
    click.echo(f"U-Net base {base}, depth {depth}, {size}x{size}: {params / 1e6:.2f} M parameters")


try:  # the service is an optional extra (`pip install dualtrack[serve]`)
    from dualtrack.cli.service import loadtest, ray_config, serve

    main.add_command(serve)
    main.add_command(loadtest)
    main.add_command(ray_config)
except ImportError:  # pragma: no cover - depends on the extra being installed
    pass


if __name__ == "__main__":
    main()
