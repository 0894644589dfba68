"""Track A build stages on the CPU: NVRTC and nvJitLink from PyPI need no GPU and no driver."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from dualtrack.compiler import kernel_build
from dualtrack.compiler.kernel_build import (
    PINNED_NVRTC,
    SOURCE_DIR,
    assemble_cubin,
    cached_assembly,
    cached_cubin,
    cached_ptx,
    check_fresh,
    compile_ptx,
    cubin_cache_key,
    main,
    parse_resources,
    ptx_image,
    ptx_path,
    regenerate,
    sources,
    toolchain_versions,
)
from dualtrack.contract.arch import ARCHES, PTX_ARCHES, parse_ptx_isa, parse_ptx_target
from dualtrack.errors import ArchError, ToolError
from dualtrack.kernels import (
    BLEND,
    CONV3X3_WGMMA,
    RESIZE_RGB,
    SPECS,
    ConvGeneralSpec,
    ConvGeometry,
    DwConvSpec,
    DwGeometry,
    spec_for_stem,
)
from dualtrack.kernels.attention import AttentionSpec
from dualtrack.kernels.streaming import StreamingSpec
from dualtrack.settings import Settings

STEMS = sorted(spec.stem for spec in SPECS)
CHECKED_IN = sorted((spec.stem, arch) for spec in SPECS for arch in spec.ptx_arches)  # each kernel's own arches


def checked_in(stem: str, arch: str) -> str:
    return ptx_path(SOURCE_DIR, SOURCE_DIR / f"{stem}.cu", arch).read_text()


def test_every_registered_kernel_has_a_source() -> None:
    assert [s.stem for s in sources()] == STEMS


def test_checked_in_ptx_is_fresh() -> None:
    # From the stamps `make ptx` writes (handwritten_ptx/ptx/inputs.json): every checked-in file's
    # inputs (source, headers, macros, NVRTC version) and text are what they were when it compiled
    # them. Compiling all of them again takes minutes (`make ptx-check` does); the test below compiles
    # a sample and holds it to the checked-in text.
    assert check_fresh(compile=False) == [], "run `make ptx` and commit the result"


# The stamps stand for a compile only if NVRTC gives the same text twice (it did not, for a plain
# float4 shared-memory read in the fp32 conv; see lds128 in conv3x3_nhwc.cu) and the text checked in.
@pytest.mark.parametrize(
    ("stem", "arch"), [("conv3x3_nhwc", "compute_80"), ("maxpool2x2_nhwc", "compute_120"), ("gap_nhwc", "compute_90a")]
)
def test_compile_is_deterministic_and_gives_the_checked_in_text(stem: str, arch: str) -> None:
    source = SOURCE_DIR / f"{stem}.cu"
    first = compile_ptx(source, arch).text
    assert compile_ptx(source, arch).text == first
    assert first == checked_in(stem, arch)


def test_every_op_of_track_a_is_checked() -> None:
    # The freshness, ISA, entry and assembly tests run over STEMS: every registered kernel.
    assert {"conv3x3_nhwc", "conv3x3_wgmma", "convt2x2_nhwc", "maxpool2x2_nhwc"} <= set(STEMS)


def test_ptx_arches_are_stated_per_kernel() -> None:
    # wgmma exists on sm_90a only: its PTX is kept (and shipped) for compute_90a alone.
    assert CONV3X3_WGMMA.ptx_arches == ("compute_90a",)
    # ... and the FP8 quantizer too (its e4m3 conversion needs sm_89+; it feeds the e4m3 wgmma rows)
    assert spec_for_stem("quantize_fp8").ptx_arches == ("compute_90a",)
    assert all(spec.ptx_arches == PTX_ARCHES for spec in SPECS if spec.ptx_arches != ("compute_90a",))
    assert [s.stem for s in SPECS if s.ptx_arches == ("compute_90a",)] == ["quantize_fp8", CONV3X3_WGMMA.stem]
    kept = {(p.stem, p.parent.name) for p in (SOURCE_DIR / "ptx").glob("*/*.ptx")}
    assert kept == set(CHECKED_IN)


@pytest.mark.parametrize(("stem", "arch"), CHECKED_IN)
def test_checked_in_ptx_isa_and_target(stem: str, arch: str) -> None:
    text = checked_in(stem, arch)
    assert parse_ptx_isa(text) == (9, 0), "driver 580 (CUDA 13.0) JITs PTX ISA 9.0 at most (FACTS 13)"
    assert parse_ptx_target(text) == arch.replace("compute_", "sm_")
    assert "\0" not in text


@pytest.mark.parametrize(("stem", "arch"), CHECKED_IN)
def test_entries_and_block_size_match_the_registry(stem: str, arch: str) -> None:
    spec = spec_for_stem(stem)
    text = checked_in(stem, arch)
    entries = dict(re.findall(r"\.entry (\w+)\([^)]*\)\s*\.maxntid (\d+)(?:, 1, 1)?\n", text))
    assert set(entries) == set(spec.entries)
    # __launch_bounds__ in the source comes from the same -D macros as launch()'s block.
    if spec is CONV3X3_WGMMA:
        for entry in spec.entries:
            assert int(entries[entry]) == spec.launch("float16", 2, 37, 37, 8, 5, entry=entry).block[0]
    elif spec is RESIZE_RGB:  # one uint8 entry, a 2-D block
        block = spec.launch(37, 29).block
        assert int(entries[spec.stem]) == block[0] * block[1] == spec.threads()
    elif spec is BLEND:  # the window path's cut, accumulate and finish: one block size
        block = spec.cut_call(1, 2, 5, 5, 2, 2, 1, [(0, 0)])[0].block[0]
        assert all(int(entries[entry]) == block == spec.threads() for entry in spec.entries)
    elif isinstance(spec, AttentionSpec):  # fp16 only, an entry per head dim, one block size
        for entry in spec.entries:
            assert int(entries[entry]) == spec.threads("float16") == spec.attention_launch(2, 3, 37).block[0]
    elif spec.stem == "quantize_fp8":  # fp16 in, e4m3 bytes out: one entry
        block = spec.launch("float16", 2, 37, 37, 3).block[0]
        assert int(entries[spec.entry("float16")]) == spec.threads("float16") == block
    elif isinstance(spec, DwConvSpec):  # the per-element entries and the tiled one
        for dtype in ("float16", "float32"):
            assert int(entries[spec.entry(dtype)]) == spec.threads(dtype)
        tile = spec.tile_launch(2, 37, 37, 40, DwGeometry(7, pads=(3, 3, 3, 3)))
        assert int(entries[spec.tile_entry]) == tile.block[0] == spec.tile_threads
    elif isinstance(spec, ConvGeneralSpec):  # its launches need a geometry; every entry's tile
        for entry in spec.entries:
            dtype = "float32" if entry == spec.entry("float32") else "float16"
            block = spec.launch(dtype, 2, 37, 37, 3, 5, geom=ConvGeometry(3, 3), entry=entry).block[0]
            assert int(entries[entry]) == block
    else:
        for dtype in ("float16", "float32"):
            assert int(entries[spec.entry(dtype)]) == spec.threads(dtype)
            if not isinstance(spec, StreamingSpec):  # the mobile kernels' launches take other sizes
                assert int(entries[spec.entry(dtype)]) == spec.launch(dtype, 2, 37, 37, 3, 5).block[0]
    if stem == "conv3x3_nhwc":  # the small-C entry's bound is its largest launch (K > 8)
        smallc = spec.smallc_entry
        assert (
            int(entries[smallc])
            == spec.threads("float16", smallc)
            == spec.launch("float16", 2, 37, 37, 3, 32, entry=smallc).block[0]
        )
    assert not re.search(r"^(\.visible\s+)?\.global\s", text, re.MULTILINE), "no device globals in Track A PTX"


def test_compile_records_what_made_it() -> None:
    artifact = compile_ptx(SOURCE_DIR / "maxpool2x2_nhwc.cu", "compute_90a")
    assert artifact.nvrtc_version == PINNED_NVRTC
    assert artifact.isa == (9, 0) and artifact.target == "sm_90a"
    assert "--gpu-architecture=compute_90a" in artifact.options and "-std=c++17" in artifact.options
    assert "-DPOOL_THREADS=256" in artifact.options
    assert not any("fast" in o for o in artifact.options)
    assert set(artifact.entries) == {"maxpool2x2_nhwc_f16", "maxpool2x2_nhwc_f32"}
    assert artifact.image == artifact.text.encode() + b"\0"


def test_ptx_image_is_nul_terminated_once() -> None:
    assert ptx_image(".version 9.0\n") == b".version 9.0\n\0"
    assert ptx_image(b".version 9.0\n\0") == b".version 9.0\n\0"


# sm_86 and sm_89 take sm_80's PTX on sm_80's register file: ptxas for them is 90 s of CI's time a kernel set
# that sm_80's row already answers for. DUALTRACK_PTX_ALL_GPUS=1 assembles for them too.
SIBLINGS = {"sm_86": "sm_80", "sm_89": "sm_80"}
ALL_GPUS = os.environ.get("DUALTRACK_PTX_ALL_GPUS") == "1"


def _gpu_param(stem: str, gpu: str):
    skip = gpu in SIBLINGS and not ALL_GPUS
    why = f"{gpu} assembles {SIBLINGS.get(gpu)}'s PTX for the same register file; DUALTRACK_PTX_ALL_GPUS=1 runs it"
    return pytest.param(stem, gpu, marks=pytest.mark.skipif(skip, reason=why))


@pytest.mark.spread  # each assembles one checked-in PTX file on its own: any pytest-xdist worker may take it
@pytest.mark.parametrize(
    ("stem", "gpu"),
    [_gpu_param(s.stem, gpu) for s in SPECS for gpu in sorted(ARCHES) if ARCHES[gpu].ptx_arch in s.ptx_arches],
)
def test_ptx_assembles_for_every_gpu(stem: str, gpu: str) -> None:
    # sm_80/86/89/100 from compute_80, sm_90a from compute_90a, sm_120 from compute_120 (arch.py);
    # conv3x3_wgmma for sm_90a only.
    # Through the run's cubin cache (tests/conftest.py: one for every worker), where the builds of other
    # tests find these cubins assembled (or this test finds theirs, with ptxas' log kept beside them).
    info = ARCHES[gpu]
    cache = Settings.from_env().cache_dir / "cubin"
    cubin = cached_assembly(checked_in(stem, info.ptx_arch), gpu, cache, name=f"{stem}.ptx")
    assert cubin.data[:4] == b"\x7fELF"
    assert cubin.arch == info.cubin_arch
    spec = spec_for_stem(stem)
    assert set(cubin.resources) == set(spec.entries)
    for entry, res in sorted(cubin.resources.items()):
        print(f"{gpu} {entry}: {res.registers} registers, {res.spill_stores}/{res.spill_loads} B spill st/ld")
        assert not res.spills, f"{entry} spills on {gpu}: {res}"
        assert res.registers <= 255
        assert res.shared_bytes <= 48 * 1024  # static shared memory (wgmma: its mbarriers; tiles are dynamic)


def test_broken_source_raises_with_the_nvrtc_log(tmp_path: Path) -> None:
    bad = tmp_path / "broken_kernel.cu"
    bad.write_text('extern "C" __global__ void k(float* p) { p[0] = undeclared_name; }\n')
    with pytest.raises(ToolError, match=r"NVRTC: nvrtcCompileProgram failed for broken_kernel\.cu") as info:
        compile_ptx(bad, "compute_80")
    assert info.value.tool == "NVRTC"
    assert "undeclared_name" in info.value.detail and "error" in info.value.detail
    assert "python -m dualtrack.compiler.kernel_build --source" in info.value.detail  # the repro command


@pytest.mark.parametrize("stem", ["conv3x3_nhwc", "convt2x2_nhwc"])
def test_missing_tile_macros_are_a_compile_error(stem: str) -> None:
    with pytest.raises(ToolError) as info:
        compile_ptx(SOURCE_DIR / f"{stem}.cu", "compute_80", defines={})
    assert "tile sizes come from dualtrack.kernels" in info.value.detail


def test_unknown_arch_raises() -> None:
    with pytest.raises(ArchError, match="compute_91"):
        compile_ptx(SOURCE_DIR / "maxpool2x2_nhwc.cu", "compute_91")
    with pytest.raises(ArchError, match="sm_91"):
        assemble_cubin(checked_in("maxpool2x2_nhwc", "compute_80"), "sm_91")


@pytest.mark.parametrize(
    ("ptx_arch", "gpu"), [("compute_90a", "sm_120"), ("compute_90a", "sm_100"), ("compute_120", "sm_90a")]
)
def test_ptx_for_another_gpu_is_refused_before_nvjitlink(ptx_arch: str, gpu: str) -> None:
    with pytest.raises(ArchError, match=f"cannot be assembled for {gpu}"):
        assemble_cubin(checked_in("maxpool2x2_nhwc", ptx_arch), gpu)


def test_nvjitlink_failure_carries_its_log() -> None:
    text = checked_in("maxpool2x2_nhwc", "compute_80").replace("max.NaN.f16x2", "max.NaN.bogus")
    # nvJitLink runs ptxas when the PTX is added, so the failing call is nvJitLinkAddData.
    with pytest.raises(ToolError, match=r"nvJitLink: nvJitLink\w+ failed for broken\.ptx -> sm_80: ERROR_PTX") as info:
        assemble_cubin(text, "sm_80", name="broken.ptx")
    assert "bogus" in info.value.detail


def test_parse_resources() -> None:
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
        "ptxas info    : Function properties for k1\n"
        "ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 143 registers, used 1 barriers, 47104 bytes smem\n"
        "ptxas info    : Compiling entry function 'k2' for 'sm_90a'\n"
        "ptxas info    : Function properties for k2\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 34 registers, used 0 barriers\n"
        "info    : Function properties for 'k1':\n"
        "info    : used 143 registers, used 1 barriers, 0 stack, 48128 bytes smem, 0 bytes lmem\n"
    )
    res = parse_resources(log)
    assert res["k1"].registers == 143 and res["k1"].spill_stores == 12 and res["k1"].spill_loads == 16
    assert res["k1"].stack_bytes == 8 and res["k1"].shared_bytes == 47104 and res["k1"].spills
    assert res["k2"].registers == 34 and res["k2"].shared_bytes == 0 and not res["k2"].spills


def test_regenerate_and_check_fresh(tmp_path: Path) -> None:
    for f in (SOURCE_DIR / "maxpool2x2_nhwc.cu", *SOURCE_DIR.glob("*.cuh")):
        shutil.copy(f, tmp_path)
    written = regenerate(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        f"ptx/{arch}/maxpool2x2_nhwc.ptx" for arch in PTX_ARCHES
    ]
    assert check_fresh(tmp_path) == []

    written[0].write_text(written[0].read_text() + "// edited\n")
    written[1].unlink()
    orphan = tmp_path / "ptx" / "compute_80" / "gone.ptx"
    orphan.write_text("// stale\n")
    assert check_fresh(tmp_path) == [
        "ptx/compute_80/maxpool2x2_nhwc.ptx (differs from maxpool2x2_nhwc.cu)",
        "ptx/compute_90a/maxpool2x2_nhwc.ptx (missing)",
        "ptx/compute_80/gone.ptx (no source)",
    ]
    assert main(["--check", "--root", str(tmp_path)]) == 1

    regenerate(tmp_path)
    assert not orphan.exists()
    assert check_fresh(tmp_path) == []
    assert main(["--check", "--root", str(tmp_path)]) == 0

    # The stamps: fresh after regenerate; a source (or header) edited, a PTX file edited, a stamp gone.
    assert check_fresh(tmp_path, compile=False) == []
    source = tmp_path / "maxpool2x2_nhwc.cu"
    source.write_text(source.read_text() + "// a comment changes the inputs\n")
    written[2].write_text(written[2].read_text() + "// edited\n")
    stamps = json.loads((tmp_path / kernel_build.STAMPS).read_text())
    del stamps["compute_90a/maxpool2x2_nhwc.ptx"]
    (tmp_path / kernel_build.STAMPS).write_text(json.dumps(stamps))
    got = check_fresh(tmp_path, compile=False)
    changed = "(differs from maxpool2x2_nhwc.cu: its inputs changed since `make ptx`)"
    assert got == [
        f"ptx/compute_80/maxpool2x2_nhwc.ptx {changed}",
        "ptx/compute_90a/maxpool2x2_nhwc.ptx (not in ptx/inputs.json)",
        f"ptx/compute_120/maxpool2x2_nhwc.ptx {changed}",
    ], got
    regenerate(tmp_path)
    assert check_fresh(tmp_path, compile=False) == []
    written[0].write_text(written[0].read_text() + "// edited\n")  # the same inputs: only the text
    edited = ["ptx/compute_80/maxpool2x2_nhwc.ptx (edited since `make ptx` wrote it)"]
    assert check_fresh(tmp_path, compile=False) == edited


def test_regenerate_builds_each_kernel_for_its_own_arches(tmp_path: Path) -> None:
    # quantize_fp8: an sm_90a-only kernel (like conv3x3_wgmma) that compiles in a second, not seventy.
    for f in (SOURCE_DIR / "quantize_fp8.cu", *SOURCE_DIR.glob("*.cuh")):
        shutil.copy(f, tmp_path)
    written = regenerate(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == ["ptx/compute_90a/quantize_fp8.ptx"]
    assert written[0].read_text() == checked_in("quantize_fp8", "compute_90a")
    extra = tmp_path / "ptx" / "compute_80" / "quantize_fp8.ptx"
    extra.parent.mkdir()
    extra.write_text("// e4m3 conversions do not exist on sm_80\n")
    assert check_fresh(tmp_path) == ["ptx/compute_80/quantize_fp8.ptx (not one of its source's PTX arches)"]
    regenerate(tmp_path)
    assert not extra.exists()


def test_cli_prints_one_ptx(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--source", str(SOURCE_DIR / "maxpool2x2_nhwc.cu"), "--arch", "compute_120"]) == 0
    out = capsys.readouterr().out
    assert out == checked_in("maxpool2x2_nhwc", "compute_120")


def test_cubin_cache_key_moves_with_every_input() -> None:
    text = checked_in("maxpool2x2_nhwc", "compute_80")
    key = cubin_cache_key(text, "sm_80")
    assert key.startswith("sm_80-")
    assert cubin_cache_key(text.encode() + b"\0", "sm_80") == key  # the loader's NUL is not a change
    assert cubin_cache_key(text, "ampere") == key  # an alias of the same arch
    assert cubin_cache_key(text, "sm_86") != key
    assert cubin_cache_key(text.replace("max.NaN.f32", "max.f32"), "sm_80") != key


def test_cached_cubin(tmp_path: Path) -> None:
    text = checked_in("maxpool2x2_nhwc", "compute_80")
    first = cached_cubin(text, "sm_86", tmp_path)
    cached = tmp_path / cubin_cache_key(text, "sm_86")
    assert cached.read_bytes() == first and first[:4] == b"\x7fELF"
    cached.write_bytes(b"from the cache")
    assert cached_cubin(text, "sm_86", tmp_path) == b"from the cache"
    assert cached_cubin(text, "sm_86", tmp_path, enabled=False) == first


def test_toolchain_versions() -> None:
    versions = toolchain_versions()
    assert versions["nvrtc"].startswith(f"{PINNED_NVRTC[0]}.{PINNED_NVRTC[1]} (nvidia-cuda-nvrtc ")
    assert versions["nvjitlink"].split()[0].count(".") == 1


def test_the_shared_header_reaches_nvrtc_in_memory_and_moves_the_ptx_cache_key(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in (SOURCE_DIR / "maxpool2x2_nhwc.cu", *SOURCE_DIR.glob("*.cuh")):
        shutil.copy(f, src)
    cache = tmp_path / "cache"
    defines = spec_for_stem("maxpool2x2_nhwc").defines()
    text = cached_ptx(src / "maxpool2x2_nhwc.cu", "compute_80", defines, cache)
    assert text == (SOURCE_DIR / "ptx" / "compute_80" / "maxpool2x2_nhwc.ptx").read_text()
    assert cached_ptx(src / "maxpool2x2_nhwc.cu", "compute_80", defines, cache) == text
    entries = sorted(cache.rglob("*.ptx"))
    header = next(src.glob("*.cuh"))
    header.write_text(header.read_text() + "\n// a comment\n")
    assert cached_ptx(src / "maxpool2x2_nhwc.cu", "compute_80", defines, cache) == text  # same code, new key
    assert len(sorted(cache.rglob("*.ptx"))) == len(entries) + 1
