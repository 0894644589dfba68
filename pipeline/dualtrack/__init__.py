"""dualtrack: compile one segmentation model along two tracks and serve it from one CUDA context.

from dualtrack import Engine, build
build("configs/unet.yaml")
with Engine.load("build/unet", device="cuda") as engine:
    masks = engine.run(images)["mask"]
"""

from dualtrack.errors import DualtrackError

__all__ = ["DualtrackError", "Engine", "build"]


def __getattr__(name: str):
    # Lazy: `import dualtrack` stays cheap (no IREE, no onnxruntime) for the CLI and the service.
    if name == "Engine":
        from dualtrack.runtime.engine import Engine

        return Engine
    if name == "build":
        from dualtrack.compiler.build import build

        return build
    raise AttributeError(name)
