"""The package's layers and the one direction of their imports (docs/architecture.md), read from the
source: every `import` and `from ... import` of every module, those inside functions included (a
lazy import is still a dependency), so a runtime module that reaches for the compiler fails here
before it ships in a serving container."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pipeline" / "dualtrack"

# Each layer and the layers it may import (itself included). Top-level modules are layers of their
# own: errors and atomic at the ground, settings and hostcpu on them, imaging (the image I/O
# contract of `dualtrack run` and the service) on the plan's TensorSpec.
_GROUND = {"errors", "atomic", "settings", "hostcpu", "imaging", "contract", "kernels"}
_RUNTIME = _GROUND | {"runtime"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "atomic": set(),
    "hostcpu": set(),
    "settings": {"errors"},
    "contract": {"errors", "atomic", "settings", "contract"},
    "imaging": {"errors", "contract"},
    "kernels": {"errors", "contract", "kernels"},
    "runtime": _RUNTIME,
    "serve": _RUNTIME | {"serve"},
    # The compiler verifies what it built by running it (the CPU engine), so it stands above the runtime.
    "compiler": _RUNTIME | {"compiler"},
    "tuning": _RUNTIME | {"compiler", "tuning"},
    "cli": _RUNTIME | {"compiler", "tuning", "serve", "cli"},
    "__init__": {"errors", "runtime", "compiler"},  # the lazy public names: Engine, build
}
# Third-party packages only the build machine has (pyproject: the compiler's dependencies).
BUILD_ONLY = ("onnx", "onnxruntime", "onnxslim", "onnxconverter_common", "iree.compiler")
SERVING_LAYERS = ("errors", "atomic", "hostcpu", "settings", "contract", "imaging", "kernels", "runtime", "serve")


def layer_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = list(path.relative_to(PKG.parent).with_suffix("").parts)[: -node.level]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((node.lineno, base))
            if base == "dualtrack":  # `from dualtrack import x`: x is the module (or a public name)
                out += [(node.lineno, f"dualtrack.{a.name}") for a in node.names]
    return out


def modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "handwritten_ptx" not in p.parts)


def test_every_module_belongs_to_a_known_layer():
    unknown = sorted({layer_of(p) for p in modules()} - set(ALLOWED))
    assert not unknown, f"modules outside the layers of docs/architecture.md: {unknown}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_run_one_way(path: Path):
    layer = layer_of(path)
    wrong = []
    for line, mod in imports(path):
        parts = mod.split(".")
        if parts[0] != "dualtrack" or len(parts) < 2:
            continue
        target = parts[1]
        if target in ("Engine", "build", "DualtrackError"):  # the package's public names
            continue
        if target not in ALLOWED[layer]:
            wrong.append(f"line {line}: {mod} ({target})")
    assert not wrong, f"{path.relative_to(PKG)} ({layer}) imports a layer it must not: {wrong}"


@pytest.mark.parametrize("path", [p for p in modules() if layer_of(p) in SERVING_LAYERS], ids=lambda p: str(p.name))
def test_serving_layers_never_import_the_build_machines_packages(path: Path):
    wrong = [f"line {line}: {mod}" for line, mod in imports(path) if mod.startswith(BUILD_ONLY)]
    assert not wrong, f"{path.relative_to(PKG)} imports a build-only package: {wrong}"


def test_the_top_level_holds_at_most_eight_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, top


def test_no_two_modules_share_a_name():
    # One name, one job: `track_b.py` beside `runtime/track_b.py` made a reader open the wrong one.
    seen: dict[str, list[str]] = {}
    for p in modules():
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.stem, []).append(str(p.relative_to(PKG)))
    for d in PKG.iterdir():
        if d.is_dir() and (d / "__init__.py").exists():
            seen.setdefault(d.name, []).append(f"{d.name}/")
    twins = {k: v for k, v in seen.items() if len(v) > 1}
    assert not twins, twins
