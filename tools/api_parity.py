"""Which public names of PyTorch's distributed tensor API shardtensor lacks (a tool: it imports torch's modules).

For each pair of modules (torch's, ours) it lists the names in torch's `__all__` that ours does not
export, then, for every class both export, the public methods and properties (and protocol dunders
such as `__create_chunk_list__`) that torch's class has beyond its non-distributed bases
(`torch.Tensor`, `nn.Module`, `TorchDispatchMode`, `object`) and ours lacks. A missing name reads
`module.name` or `module.Class.member`, with torch's module name.

    python tools/api_parity.py          # prints the missing names, one a line
"""

from __future__ import annotations

import importlib
import inspect

# (torch module, shardtensor module): users switch by changing the import from the first to the second.
MODULE_PAIRS = [
    ("torch.distributed.tensor", "shardtensor"),
    ("torch.distributed.tensor.placement_types", "shardtensor.placement_types"),
    ("torch.distributed.device_mesh", "shardtensor.device_mesh"),
    ("torch.distributed.tensor.parallel", "shardtensor.parallel"),
    ("torch.distributed.tensor.debug", "shardtensor.debug"),
    ("torch.distributed.tensor.experimental", "shardtensor.experimental"),
    ("torch.distributed.fsdp", "shardtensor.fsdp"),
]


def public_names(module) -> list[str]:
    """The module's `__all__`, or its attributes without a leading underscore when it has none."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in vars(module) if not name.startswith("_")]
    return list(names)


def _is_member_name(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _foreign_names(cls: type) -> set[str]:
    """Names `cls` inherits from bases outside torch.distributed (torch.Tensor, nn.Module, object, ...)."""
    names: set[str] = set(dir(object))
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith("torch.distributed"):
            names.update(dir(base))
    return names


def class_members(cls: type) -> set[str]:
    """Public members and protocol dunders of torch's `cls` that its non-distributed bases lack."""
    foreign = _foreign_names(cls)
    return {name for name in dir(cls) if _is_member_name(name) and name not in foreign and name != "__slots__"}


def missing_names() -> list[str]:
    """Every torch name of `MODULE_PAIRS` that shardtensor lacks, sorted."""
    missing = []
    for torch_name, our_name in MODULE_PAIRS:
        theirs = importlib.import_module(torch_name)
        try:
            ours = importlib.import_module(our_name)
        except ImportError:
            missing.append(torch_name)
            continue
        for name in public_names(theirs):
            if not hasattr(ours, name):
                missing.append(f"{torch_name}.{name}")
                continue
            their_object, our_object = getattr(theirs, name), getattr(ours, name)
            if inspect.isclass(their_object) and inspect.isclass(our_object):
                for member in sorted(class_members(their_object)):
                    if not hasattr(our_object, member):
                        missing.append(f"{torch_name}.{name}.{member}")
    return sorted(set(missing))


if __name__ == "__main__":
    for name in missing_names():
        print(name)
