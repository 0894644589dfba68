"""One error hierarchy for dualtrack.

Every error a user can cause derives from :class:`DualtrackError`. Each class carries the exit code
the CLI returns for it (documented in README.md, "Exit codes"), so the CLI maps any error to one
line and one code without a lookup table of its own.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any


class DualtrackError(Exception):
    """Base class of every error dualtrack raises on purpose.

    The message is one line that names the value, the limit and the fix. ``detail`` holds
    anything longer (a JIT log, a tool's stderr); the CLI prints it only with ``--verbose``.
    """

    exit_code = 1

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def __str__(self) -> str:
        return self.message


class InternalError(DualtrackError):
    """dualtrack broke its own invariant (a front-end stage wrote a model the ONNX checker rejects):
    a bug, reported as one line that names the stage, with the documented internal-error exit code."""

    exit_code = 1


class ConfigError(DualtrackError):
    """The YAML config is malformed, has an unknown key, or holds an invalid value."""

    exit_code = 2


class ModelError(DualtrackError):
    """The ONNX model is missing, unreadable, or fails the ONNX checker."""

    exit_code = 3


class PartitionError(DualtrackError):
    """The partition names nodes that do not exist, or puts an op on a track that cannot take it."""

    exit_code = 4


class UnsupportedOpError(PartitionError):
    """An op that no track can take."""


class ArchError(DualtrackError):
    """An architecture that no toolchain can target, or that a bundle has no code for."""

    exit_code = 5


class ToolError(DualtrackError):
    """An external tool (iree-import-onnx, iree-compile, NVRTC, nvJitLink) failed.

    Keeps the tool, its exit code, its stderr and a command a user can paste to reproduce it.
    """

    exit_code = 6

    def __init__(
        self,
        tool: str,
        message: str,
        *,
        returncode: int | None = None,
        stderr: str = "",
        argv: Sequence[str] = (),
    ) -> None:
        self.tool = tool
        self.returncode = returncode
        self.stderr = stderr
        self.argv = list(argv)
        repro = shlex.join(self.argv) if self.argv else ""
        detail = "\n".join(
            part
            for part in (
                f"exit code: {returncode}" if returncode is not None else "",
                f"reproduce with: {repro}" if repro else "",
                stderr.strip(),
            )
            if part
        )
        super().__init__(f"{tool}: {message}", detail=detail)

    @property
    def repro(self) -> str:
        return shlex.join(self.argv)


class SegmentCompileError(ToolError):
    """IREE failed on one Track B segment for one target (``segment``: the plan's name, ``seg3_B``)."""

    def __init__(self, segment: str, target: str, tool: str, message: str, **kw: Any) -> None:
        self.segment, self.target = segment, target
        super().__init__(tool, message, **kw)


class VerificationError(DualtrackError):
    """A segment or the whole plan exceeded its numeric tolerance against onnxruntime."""

    exit_code = 7


class BundleError(DualtrackError):
    """A bundle is missing, corrupt, truncated, or was built for another model or format."""

    exit_code = 8


class DeviceError(DualtrackError):
    """No GPU, a driver too old for the PTX, a JIT failure, or out of device memory."""

    exit_code = 9


class CudaError(DeviceError):
    """A CUDA Driver API call failed: carries the CUresult name and the driver's explanation."""

    def __init__(self, call: str, name: str, explanation: str, *, log: str = "") -> None:
        self.call = call
        self.name = name
        self.explanation = explanation
        super().__init__(f"{call} failed: {name}: {explanation}", detail=log)


class InputError(DualtrackError):
    """An input of the wrong shape or dtype, or an image file that is not an image."""

    exit_code = 10


EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "internal error (a bug: please report it with --verbose output)",
    ConfigError.exit_code: "bad config (YAML syntax, unknown key, invalid value)",
    ModelError.exit_code: "bad or missing ONNX model",
    PartitionError.exit_code: "partition cannot be built (unknown node, op no track can take)",
    ArchError.exit_code: "architecture no toolchain can target, or no code for this device",
    ToolError.exit_code: "an external compiler tool failed",
    VerificationError.exit_code: "numeric verification against onnxruntime failed",
    BundleError.exit_code: "bundle missing, corrupt or mismatched",
    DeviceError.exit_code: "GPU or driver problem (no GPU, driver too old, JIT failure, out of memory)",
    InputError.exit_code: "bad input (shape, dtype, not an image)",
}
