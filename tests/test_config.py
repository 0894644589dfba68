"""Config loading: the reference config, YAML and schema errors with their location, and the
translation of the seed's vocabulary into real settings (pure logic, no model, no tools)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualtrack.compiler.config import BuildConfig, load_config
from dualtrack.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- the reference config ---------------------------------------------------------------------


def test_reference_config_loads() -> None:
    cfg = load_config(REPO / "configs" / "unet.yaml")
    assert isinstance(cfg, BuildConfig)
    assert cfg.model == (REPO / "models" / "unet_fp16.onnx").resolve()
    assert cfg.output == (REPO / "build" / "unet").resolve()
    assert cfg.precision == "fp16"
    assert cfg.batch_sizes == (1, 8)
    assert cfg.targets == ("sm_90a", "sm_80", "sm_120")
    assert cfg.partition.track_a.name_prefixes == ("enc", "mid/", "dec", "head/", "post/", "probs", "mask")
    assert cfg.input.shape == (1, 512, 512, 3) and cfg.input.dtype == "uint8"
    assert all(f.startswith("--") for f in cfg.track_b.cuda_flags)
    assert cfg.notes == ()  # nothing of the seed's vocabulary left to translate


def test_tiny_config_paths_resolve_against_the_config_folder(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model: sub/m.onnx\noutput: out/b\nbatch_sizes: [4, 1, 4]\n"))
    assert cfg.model == (tmp_path / "sub" / "m.onnx").resolve()
    assert cfg.output == (tmp_path / "out" / "b").resolve()
    assert cfg.batch_sizes == (1, 4)  # sorted, deduplicated


# --- YAML and file errors ---------------------------------------------------------------------


def test_malformed_yaml_names_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\ntargets: [sm_90a\nbatch_sizes: [1]\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3:12: invalid YAML: expected ',' or ']'"):
        load_config(path)


def test_tab_indentation_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\n\tprecision: fp32\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2:1: invalid YAML: found character '\\t'"):
        load_config(path)


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("", "NoneType"), ("just a string\n", "str")])
def test_config_that_is_not_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    with pytest.raises(ConfigError, match=rf"the config must be a YAML mapping \(key: value lines\), not {kind}$"):
        load_config(write(tmp_path, text))


def test_missing_config_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"^config file {path} not found; pass the path of a YAML config"):
        load_config(path)


def test_config_path_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^cannot read config {tmp_path}: Is a directory"):
        load_config(tmp_path)


# --- unknown keys -----------------------------------------------------------------------------


def test_unknown_top_level_key_names_it_and_the_nearest(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\nbatch_size: [1]\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: unknown key `batch_size`; did you mean `batch_sizes`\?$"):
        load_config(path)


def test_unknown_nested_key_names_it_and_the_nearest(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\npartition:\n  track_a:\n    name_prefix: [enc]\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}:4: unknown key `partition.track_a.name_prefix`; did you mean `name_prefixes`\?$"
    ):
        load_config(path)


def test_unknown_key_under_track_b(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\ntrack_b:\n  cuda_flag: [--x]\n")
    with pytest.raises(ConfigError, match=r":3: unknown key `track_b.cuda_flag`; did you mean `cuda_flags`\?$"):
        load_config(path)


def test_unknown_key_far_from_any_lists_the_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\nverify:\n  zzzzzz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key `verify.zzzzzz`; valid keys here: samples, seed, tolerance$"):
        load_config(path)


def test_unknown_key_under_an_optional_section_lists_the_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\nverify:\n  tolerance: {rel_l2: 0.1, max_abs: 1, mismatch: 0, rel_l3: 1}\n")
    with pytest.raises(ConfigError, match=r"unknown key `verify.tolerance.rel_l3`; did you mean `rel_l2`\?"):
        load_config(path)


# --- wrong values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("batch_sizes: one\n", r":2: `batch_sizes`: Input should be a valid tuple"),
        (
            "batch_sizes: [0]\n",
            r":2: `batch_sizes`: Value error, batch_sizes must be positive integers, e\.g\. \[1, 8\]",
        ),
        ("batch_sizes: [1, -2]\n", r":2: `batch_sizes`: Value error, batch_sizes must be positive integers"),
        ("precision: int8\n", r":2: `precision`: Input should be 'fp16', 'fp32' or 'fp8'"),
        ("enable_tma: maybe\n", r":2: `enable_tma`: Input should be a valid boolean"),
        ("verify: {samples: 0}\n", r":2: `verify.samples`: Input should be greater than or equal to 1"),
        ("input: {shape: [1, a]}\n", r":2: `input.shape.1`: Input should be a valid integer"),
        ("input: {dtype: int8}\n", r":2: `input.dtype`: Input should be 'uint8', 'float16' or 'float32'"),
        ("targets: sm_90a\n", r":2: `targets`: Input should be a valid tuple"),
        ("track_b: {cpu: sometimes}\n", r":2: `track_b.cpu`: Input should be a valid boolean"),
    ],
)
def test_wrong_value_types_name_the_key_and_its_line(tmp_path: Path, text: str, pattern: str) -> None:
    path = write(tmp_path, "model: m.onnx\n" + text)
    with pytest.raises(ConfigError, match=rf"^{path}{pattern}"):
        load_config(path)


def test_empty_batch_sizes(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\nbatch_sizes: []\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}:2: `batch_sizes`: Value error, batch_sizes must be positive integers"
    ):
        load_config(path)


def test_a_whole_config_error_names_no_empty_key(tmp_path: Path) -> None:
    """A validator of the whole config (here: calibration without fp8) has no key to point at."""
    path = write(tmp_path, "model: m.onnx\ncalibration:\n  samples: 4\n")
    with pytest.raises(ConfigError, match=rf"^{path}: Value error, `calibration:` applies to `precision: fp8`") as e:
        load_config(path)
    assert "``" not in str(e.value) and "\n" not in str(e.value)


def test_missing_model_key(tmp_path: Path) -> None:
    path = write(tmp_path, "precision: fp32\n")
    with pytest.raises(ConfigError, match=rf"^{path}: `model`: Field required$"):
        load_config(path)


def test_several_errors_report_the_first_and_count_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\nprecision: int8\nenable_tma: maybe\n")
    with pytest.raises(ConfigError, match=r":2: `precision`: .* \(and 1 more\)$"):
        load_config(path)


@pytest.mark.parametrize("key", ["flags", "cuda_flags", "cpu_flags"])
def test_flag_without_dashes_is_rejected(tmp_path: Path, key: str) -> None:
    path = write(tmp_path, f"model: m.onnx\ntrack_b:\n  {key}: [--iree-opt-level=O3, O3]\n")
    with pytest.raises(ConfigError, match=r"'O3' is not an iree-compile flag \(flags start with --"):
        load_config(path)


def test_flag_without_dashes_names_its_key_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.onnx\ntrack_b:\n  cuda_flags: [O3]\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}:3: .*track_b\.cuda_flags.*'O3' is not an iree-compile flag"
    ) as err:
        load_config(path)
    assert "``" not in str(err.value)


@pytest.mark.parametrize("text", ["iree_flags: 5\n", "arch: 90\n"])
def test_seed_key_of_the_wrong_type_is_a_config_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, "model: m.onnx\n" + text))


def test_seed_iree_flags_as_a_single_string(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model: m.onnx\niree_flags: --iree-opt-level=O3\n"))
    assert cfg.track_b.flags == ("--iree-opt-level=O3",)


# --- the seed's vocabulary --------------------------------------------------------------------


def test_seed_vocabulary_is_translated_not_passed_through(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: m.onnx\narch: sm_90\n"
        "iree_flags: [--iree-cuda-arch=sm_90a, --iree-cuda-enable-tma, --iree-opt-level=O3]\n",
    )
    cfg = load_config(path)
    assert set(cfg.targets) == {"sm_90", "sm_90a"}  # both resolve to sm_90a (arch.resolve_targets dedups)
    assert cfg.enable_tma is True
    # Only the real iree-compile flag survives; the two that do not exist never reach the tool.
    assert cfg.track_b.flags == ("--iree-opt-level=O3",)
    assert not any("iree-cuda" in f for f in (*cfg.track_b.flags, *cfg.track_b.cuda_flags, *cfg.track_b.cpu_flags))
    notes = "\n".join(cfg.notes)
    assert "`arch` is read as `targets`" in notes
    assert "`iree_flags` is read as `track_b.flags`" in notes
    assert "`--iree-cuda-arch=sm_90a` does not exist in IREE 3.13; sm_90a added to `targets`" in notes
    assert "`--iree-cuda-enable-tma` dropped: IREE 3.13 has no TMA option" in notes


def test_seed_iree_cuda_target_moves_to_iree_target(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model: m.onnx\niree_flags: [--iree-cuda-target=sm_89]\n"))
    assert cfg.track_b.iree_target == "sm_89"
    assert cfg.track_b.flags == ()
    assert "`--iree-cuda-target=sm_89` moved to `track_b.iree_target`" in cfg.notes


def test_seed_arch_list_and_tma_key(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model: m.onnx\narchs: [sm_80, sm_120]\ntma: true\n"))
    assert cfg.targets == ("sm_80", "sm_120")
    assert cfg.enable_tma is True
    assert "`archs` is read as `targets`" in cfg.notes and "`tma` is read as `enable_tma`" in cfg.notes


def test_seed_flags_inside_track_b_are_translated_too(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model: m.onnx\ntrack_b:\n  flags: [--iree-cuda-enable-tma]\n"))
    assert cfg.enable_tma is True and cfg.track_b.flags == ()
