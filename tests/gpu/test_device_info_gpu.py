"""DeviceInfo from cuDeviceGetAttribute (runtime.driver.Device.info) against the build-time table
row of the same GPU class (kernels/device.py), and the chooser planning with it."""

from __future__ import annotations

import pytest

from dualtrack import kernels
from dualtrack.kernels.device import DEVICES
from dualtrack.kernels.problems import ConvProblem
from dualtrack.runtime.driver import Device

pytestmark = pytest.mark.gpu


def test_the_attributes_match_the_table_row_of_this_gpu_class() -> None:
    info = Device(0).info()
    assert info.sm_count > 0 and info.max_grid[0] == 2**31 - 1 and info.shared_per_block <= info.shared_per_sm
    assert info.source == "cuDeviceGetAttribute" and info.name
    row = DEVICES.get(info.key)
    if row is None:
        pytest.skip(f"{info.name} ({info.key}) has no row of its own in kernels.device.DEVICES")
    assert (info.cc, info.sm_count, info.max_grid) == (row.cc, row.sm_count, row.max_grid)
    assert (info.shared_per_block, info.shared_per_sm) == (row.shared_per_block, row.shared_per_sm)
    assert abs(info.l2_bytes - row.l2_bytes) <= row.l2_bytes // 8  # datasheets round the L2 size


def test_the_chooser_plans_a_full_wave_on_this_gpu() -> None:
    info = Device(0).info()
    # As many 128x64 tiles as a full wave at 4 a SM: the default entry; one tile fewer: the small one.
    tiles = info.full_wave(4)
    off = "this test asks for the mma.sync entries"
    assert (
        kernels.conv_choice(ConvProblem.dense(1, 128, tiles, 64, 64), info, wgmma_off=off).entry == "conv3x3_nhwc_f16"
    )
    small = kernels.conv_choice(ConvProblem.dense(1, 128, tiles - 1, 64, 64), info, wgmma_off=off)
    assert small.entry == "conv3x3_nhwc_f16_small"
