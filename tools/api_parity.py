"""Which public names of PyTorch's distributed tensor API shardtensor lacks (a tool: it imports torch's modules).

For each pair of modules (torch's, ours) it lists the names in torch's `__all__` that ours does not
export, then, for every class both export, the public methods and properties (and protocol dunders
such as `__create_chunk_list__`) that torch's class has beyond its non-distributed bases
(`torch.Tensor`, `nn.Module`, `TorchDispatchMode`, `object`) and ours lacks, and, for every function
and method both have, the parameters of torch's that ours does not take. A missing name reads
`module.name`, `module.Class.member` or `module.Class.member(parameter)`, with torch's module name.

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


# Class plumbing, not API: Python's bookkeeping of a class, weak references, and pickling (ours pickles through
# `__reduce__`, tested by behaviour).
_PLUMBING = {
    "__module__", "__doc__", "__annotations__", "__firstlineno__", "__static_attributes__", "__orig_bases__",
    "__parameters__", "__abstractmethods__", "__slots__", "__weakref__", "__dict__",
    "__getstate__", "__setstate__", "__reduce__", "__reduce_ex__",
}


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
    return {name for name in dir(cls) if _is_member_name(name) and name not in foreign and name not in _PLUMBING}


def missing_parameters(theirs, ours) -> list[str]:
    """Parameters of callable `theirs` that callable `ours` does not take (none when ours takes **kwargs)."""
    try:
        their_parameters = inspect.signature(theirs).parameters
        our_parameters = inspect.signature(ours).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return []
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in our_parameters.values()):
        return []
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, parameter in their_parameters.items() if parameter.kind in plain and name not in our_parameters]


def _function(value):
    """The function behind a property's getter aside, a method or a function; None for data and classes."""
    if inspect.isclass(value) or isinstance(value, property):
        return None
    return value if callable(value) else None


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
                        continue
                    if member.startswith("__"):
                        continue  # dunders are called positionally by Python or torch: their parameter names do not matter
                    their_member = _function(inspect.getattr_static(their_object, member))
                    our_member = _function(inspect.getattr_static(our_object, member))
                    if their_member is not None and our_member is not None:
                        missing += [f"{torch_name}.{name}.{member}({parameter})"
                                    for parameter in missing_parameters(their_member, our_member)]
            elif _function(their_object) is not None and _function(our_object) is not None:
                missing += [f"{torch_name}.{name}({parameter})" for parameter in missing_parameters(their_object, our_object)]
    return sorted(set(missing))


if __name__ == "__main__":
    for name in missing_names():
        print(name)
