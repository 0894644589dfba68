#!/usr/bin/env python3
"""Which Track A choice makes a bundle fail its first-load GPU self-check (runtime/selfcheck.py): the
bundle is loaded once as built and once with each choice undone in this process (the launches are
prepared at load, so a patched chooser takes effect there), the self-check's record cleared before
each load so that every load checks.

    VARIANTS="base no_dwtile" python bench/self_check_bisect.py BUNDLE [BUNDLE ...]

Variants: ``base``; ``no_dwtile`` (depthwise convs on the per-element entry, not the tiles);
``no_split`` (no split-K); ``old_direct`` (the direct entry for every K <= 8 conv); ``no_stem`` (no stem
entries); ``no_wgmma`` (DUALTRACK_WGMMA=0); ``track_b_iree`` (Track B through the IREE runtime, not the
replay). Needs a GPU; DUALTRACK_CACHE_DIR names the cache whose ``verified`` records are cleared.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from dualtrack.kernels.conv_general import ConvGeneralSpec
from dualtrack.kernels.dwconv import DwConvSpec
from dualtrack.runtime.engine import Engine
from dualtrack.settings import Settings

ORIGINAL = (DwConvSpec.tile_path, ConvGeneralSpec.split_k, ConvGeneralSpec.direct_serial, ConvGeneralSpec.stem_entry)
ENV = ("DUALTRACK_WGMMA", "DUALTRACK_TRACK_B")


def restore() -> None:
    DwConvSpec.tile_path, ConvGeneralSpec.split_k, ConvGeneralSpec.direct_serial, ConvGeneralSpec.stem_entry = ORIGINAL
    for name in ENV:
        os.environ.pop(name, None)


VARIANTS: dict[str, Callable[[], None]] = {
    "base": lambda: None,
    "no_dwtile": lambda: setattr(DwConvSpec, "tile_path", lambda self, *a, **k: False),
    "no_split": lambda: setattr(ConvGeneralSpec, "split_k", lambda self, *a, **k: 1),
    "old_direct": lambda: setattr(ConvGeneralSpec, "direct_serial", lambda self, *a, **k: None),
    "no_stem": lambda: setattr(ConvGeneralSpec, "stem_entry", lambda self, *a, **k: None),
    "no_wgmma": lambda: os.environ.__setitem__("DUALTRACK_WGMMA", "0"),
    "track_b_iree": lambda: os.environ.__setitem__("DUALTRACK_TRACK_B", "iree"),
}


def main(argv: list[str]) -> int:
    wanted = os.environ.get("VARIANTS", "").split() or list(VARIANTS)
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown or not argv:
        print(f"usage: VARIANTS='{' '.join(VARIANTS)}' self_check_bisect.py BUNDLE...; unknown: {unknown}")
        return 2
    for bundle in argv:
        for name in wanted:
            restore()
            VARIANTS[name]()
            shutil.rmtree(Settings.from_env().cache_dir / "verified", ignore_errors=True)
            try:
                with Engine.load(bundle, device="cuda"):
                    print(f"{Path(bundle).name} {name}: the self-check passed", flush=True)
            except Exception as exc:  # the report of each variant is the point: keep going
                print(f"{Path(bundle).name} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    restore()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
