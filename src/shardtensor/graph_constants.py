"""How torch.compile holds our value types (placements, layouts, meshes) in a graph: as constants.

Torch's opaque-object mechanism compares them with `==` (guards), hashes them and writes them into a
graph's code by their `__fx_repr__`. Torch 2.14 names the registration `register_custom_class(typ=
"constant")` and logs a deprecation warning for the 2.13 name `register_opaque_type(typ="value")`, so
each torch gets the name it has.
"""

from __future__ import annotations

import torch._library.opaque_object as _opaque_object
from torch._library.opaque_object import MemberType

__all__ = ["MemberType", "register_graph_constant"]


def register_graph_constant(cls: type, members: dict[str, MemberType] | None = None) -> None:
    """Register `cls` (with `__eq__`, `__hash__` and `__fx_repr__`) as a value a graph holds as a constant;
    `members` are methods and properties dynamo evaluates on the real object while tracing."""
    register = getattr(_opaque_object, "register_custom_class", None)
    if register is not None:
        register(cls, typ="constant", members=members)
    else:
        _opaque_object.register_opaque_type(cls, typ="value", members=members)
