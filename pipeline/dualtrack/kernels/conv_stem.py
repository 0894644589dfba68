"""The general conv's ``_stem`` entries: fp16 convolutions of few input channels on the tensor cores.

A network's first convolution reads RGB (C = 3) or a grayscale image: too few channels for the
implicit GEMM's 16-byte copies, so its tiles gather the A operand element by element, once per tap.
``conv_nhwc_f16_stem`` (handwritten_ptx/conv_stem.cuh, compiled into conv_nhwc.cu) instead stages the
input patch of a tile of output pixels once in shared memory and builds the mma.sync fragments from
it through a per-k offset table. :class:`StemTile` is one entry's tile; the shared memory a launch
needs depends on its window and channels (:meth:`StemTile.shared_bytes`, the same arithmetic as the
kernel's ``stem::layout``), and a layer whose patch and filters do not fit
:data:`SHARED_LIMIT` stays on the GEMM tiles. :class:`~dualtrack.kernels.conv_general.ConvGeneralSpec`
asks :meth:`StemTile.refusal` and launches with :meth:`StemTile.launch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dualtrack.errors import InputError
from dualtrack.kernels.base import GRID_Y_MAX, LaunchConfig, cdiv

if TYPE_CHECKING:  # annotations only: conv_general imports this module
    from dualtrack.kernels.conv_general import ConvGeometry
    from dualtrack.kernels.device import DeviceInfo

STEM_C_MAX = 8  # input channels (group 1): a patch pixel is at most 16 bytes
# Dynamic shared memory a launch may take without opting in (cuFuncSetAttribute): the entries stay
# under it, so the runtime launches them as it does every other entry.
SHARED_LIMIT = 48 * 1024


@dataclass(frozen=True)
class StemTile:
    """A block's output tile: ``rows`` output rows (a warp each) x 32 columns x ``bn`` channels;
    ``min_blocks`` its ``__launch_bounds__`` occupancy (what the grid plans per SM at most)."""

    rows: int
    bn: int
    min_blocks: int

    COLS: ClassVar[int] = 32  # output columns a tile: a warp's two m16 tiles

    @property
    def threads(self) -> int:
        return 32 * self.rows

    def macro(self) -> str:
        """The ``-D`` value of its entry (``TP,BN,MIN_BLOCKS`` of conv_stem.cuh's ``stem::Tile``)."""
        return f"{self.rows},{self.bn},{self.min_blocks}"

    def shared_bytes(self, C: int, geom: ConvGeometry) -> int:
        """Dynamic shared memory of a launch on C input channels: the patch (or the epilogue tile, which
        reuses it), the block's filters and the k-pair offset table (``stem::layout``)."""
        cp = C + (C & 1)
        kp = cdiv(geom.R * geom.S * cp, 16) * 16
        ph = (self.rows - 1) * geom.stride_h + (geom.R - 1) * geom.dil_h + 1
        pw = (self.COLS - 1) * geom.stride_w + (geom.S - 1) * geom.dil_w + 1
        epi = self.rows * self.COLS * (min(self.bn, 32) + 8) * 4  # fp32 rows of a 32-channel pass
        region = cdiv(max(ph * pw * cp * 2, epi), 16) * 16
        return region + self.bn * (kp + 8) * 2 + kp // 2 * 4

    def refusal(self, C: int, geom: ConvGeometry) -> str | None:
        """Why this entry does not take a layer of C input channels (all of them: group 1), or None."""
        if geom.groups != 1:
            return f"group={geom.groups}: the stem entry takes group 1"
        if C > STEM_C_MAX:
            return f"C={C} > {STEM_C_MAX} input channels"
        need = self.shared_bytes(C, geom)
        if need > SHARED_LIMIT:
            return f"{geom.label()} on C={C} needs {need} B of shared memory, over {SHARED_LIMIT}"
        return None

    def launch(self, N: int, P: int, Q: int, K: int, C: int, geom: ConvGeometry, device: DeviceInfo) -> LaunchConfig:
        """Blocks that walk the N x ceil(P/rows) x ceil(Q/32) output tiles (grid-stride along x,
        each loading its filters once), as many as fit the device's SMs; K tiles along y."""
        smem = self.shared_bytes(C, geom)
        tiles = N * cdiv(P, self.rows) * cdiv(Q, self.COLS)
        per_sm = max(1, min(self.min_blocks, device.shared_per_sm // (smem + 1024)))
        grid_x = max(1, min(tiles, device.sm_count * per_sm))
        if cdiv(K, self.bn) > GRID_Y_MAX:
            raise InputError(
                f"K={K} output channels need {cdiv(K, self.bn)} channel tiles; the grid allows {GRID_Y_MAX}"
            )
        return LaunchConfig(grid=(grid_x, cdiv(K, self.bn), 1), block=(self.threads, 1, 1), shared_bytes=smem)
