"""Two questions every front-end pass asks of an ONNX graph: which tensors are constants (and their
values), and a name not yet taken for a tensor or node it adds."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


def constants(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and Constant nodes' values (``value`` tensors), by name."""
    out = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    out.update(
        (n.output[0], numpy_helper.to_array(n.attribute[0].t))
        for n in g.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    )
    return out


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base`` with the first number that makes it new; added to ``taken``."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}{k}"
    taken.add(name)
    return name


__all__ = ["constants", "fresh_name"]
