"""Exchange with PyTorch's `torch.distributed.tensor.DTensor`: `DTensor.from_dtensor(t)` and `x.to_dtensor()`.

A model parallelized by PyTorch's stack (transformers' `from_pretrained(tp_plan=...)`, torchtitan) holds
torch DTensors; these conversions hand them over and back without copying a shard: each side's
differentiable `to_local` feeds the other's `from_local` with the global shape and stride given, so the
local tensor keeps its storage, no collective runs, and gradients flow across the conversion.

PyTorch's layouts are the `torch.chunk` ones in the default shard order; an uneven layout of ours that
is not `torch.chunk`'s (or a placement torch lacks, such as `NormPartial`) is refused, naming the fix.
Meshes map both ways over the same process groups (`DeviceMesh.from_group` on each side, no new group),
cached per mesh for the current world.

This is the one module of `src/` that imports `torch.distributed.tensor` and `torch.distributed.device_mesh`,
lazily inside the conversions (`tests/test_engine_shape.py` allows exactly this place).
"""

from __future__ import annotations

from .layout import Layout
from .mesh import DeviceMesh
from .placement import Partial, Replicate, Shard
from .process_groups import on_new_world

__all__ = ["from_torch_dtensor", "to_torch_dtensor"]

# Our mesh -> torch's, and id(torch mesh) -> (torch mesh, ours): a mesh converted back is the one it came from.
_torch_meshes: dict = {}
_our_meshes: dict[int, tuple[object, DeviceMesh]] = {}


def _forget_meshes() -> None:
    _torch_meshes.clear()
    _our_meshes.clear()


on_new_world(_forget_meshes)


def to_torch_dtensor(dtensor):
    """PyTorch's DTensor over the same shard (same storage), mesh ranks and placements (differentiable)."""
    # The lazy import the module docstring speaks of: torch's DTensor is loaded only by a conversion.
    from torch.distributed.tensor import DTensor as TorchDTensor

    layout = dtensor.sharding
    if not layout.is_chunked() or not layout.has_default_shard_order():
        raise ValueError(_uneven_error(dtensor))
    placements = [_converted_placement(placement, to_torch=True) for placement in layout.placements]
    if None in placements:
        raise ValueError(_no_torch_placement_error(dtensor))
    mesh = _torch_mesh(dtensor.device_mesh)
    return TorchDTensor.from_local(dtensor.to_local(), mesh, placements, run_check=False,
                                   shape=tuple(dtensor.shape), stride=tuple(dtensor.stride()))


def from_torch_dtensor(cls, tensor):
    """Our `cls` DTensor over the shard of PyTorch's DTensor `tensor` (same storage; differentiable)."""
    from torch.distributed.tensor import DTensor as TorchDTensor

    if not isinstance(tensor, TorchDTensor):
        raise TypeError(
            f"from_dtensor takes a torch.distributed.tensor.DTensor, got {type(tensor).__name__}; for a plain "
            f"tensor use distribute_tensor or DTensor.from_local"
        )
    spec = tensor._spec
    order = getattr(spec, "shard_order", None)
    if order is not None and order != type(spec).compute_default_shard_order(spec.placements):
        raise ValueError(
            f"from_dtensor: the DTensor's shard order {order} is not the default one (ascending mesh dims) for "
            f"placements {spec.placements}; redistribute it in torch to a default order first"
        )
    placements = tuple(_converted_placement(placement, to_torch=False) for placement in tensor.placements)
    if None in placements:
        raise ValueError(_no_placement_here_error(tensor))
    mesh = _our_mesh(tensor.device_mesh)
    return cls.from_local(tensor.to_local(), mesh, placements, shape=tuple(tensor.shape), stride=tuple(tensor.stride()))


# The placements both libraries have, one row each: ours, torch's (its name in torch.distributed.tensor),
# and the fields that carry over, in the order both constructors take them.
_PLACEMENT_PAIRS = (
    (Shard, "Shard", ("dim",)),
    (Replicate, "Replicate", ()),
    (Partial, "Partial", ("reduce_op",)),
)


def _converted_placement(placement, to_torch: bool):
    """`placement` as the other library's placement (`to_torch`: ours to torch's), or None when it has none."""
    import torch.distributed.tensor as torch_tensor

    for ours, torch_name, fields in _PLACEMENT_PAIRS:
        theirs = getattr(torch_tensor, torch_name)
        source, target = (ours, theirs) if to_torch else (theirs, ours)
        if type(placement) is source:
            return target(*(getattr(placement, field) for field in fields))
    return None


def _torch_mesh(mesh: DeviceMesh):
    """PyTorch's DeviceMesh over this mesh's process groups (made once per mesh)."""
    torch_mesh = _torch_meshes.get(mesh)
    if torch_mesh is not None:
        return torch_mesh
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if mesh.get_coordinate() is None:
        raise RuntimeError(_outside_error("to_dtensor", mesh))
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        torch_mesh = TorchDeviceMesh.from_group(mesh.get_group(0), mesh.device_type, mesh=mesh.mesh,
                                                mesh_dim_names=names)
    else:  # torch asks for names with several groups
        names = names or tuple(f"mesh_dim_{mesh_dim}" for mesh_dim in range(mesh.ndim))
        torch_mesh = TorchDeviceMesh.from_group(mesh.get_all_groups(), mesh.device_type, mesh=mesh.mesh,
                                                mesh_dim_names=names)
    _torch_meshes[mesh] = torch_mesh
    _our_meshes[id(torch_mesh)] = (torch_mesh, mesh)
    return torch_mesh


def _our_mesh(torch_mesh) -> DeviceMesh:
    """Our mesh over a PyTorch mesh's process groups: the mesh it was made from, else a new one (made once)."""
    known = _our_meshes.get(id(torch_mesh))
    if known is not None and known[0] is torch_mesh:
        return known[1]
    if torch_mesh.get_coordinate() is None:
        raise RuntimeError(_outside_error("from_dtensor", torch_mesh))
    names = torch_mesh.mesh_dim_names
    if torch_mesh.ndim == 1:
        mesh = DeviceMesh.from_group(torch_mesh.get_group(0), torch_mesh.device_type, mesh=torch_mesh.mesh.tolist(),
                                     mesh_dim_names=names)
    else:  # ours asks for names with several groups, as torch does
        names = names or tuple(f"mesh_dim_{mesh_dim}" for mesh_dim in range(torch_mesh.ndim))
        mesh = DeviceMesh.from_group(torch_mesh.get_all_groups(), torch_mesh.device_type, torch_mesh.mesh.tolist(),
                                     mesh_dim_names=names)
    _our_meshes[id(torch_mesh)] = (torch_mesh, mesh)
    _torch_meshes.setdefault(mesh, torch_mesh)
    return mesh


def _outside_error(function: str, mesh) -> str:
    return (f"{function}: this rank is not in {mesh!r}; the conversion runs on the ranks of the mesh, which hold "
            f"the shards")


def _no_torch_placement_error(dtensor) -> str:
    placement = next(placement for placement in dtensor.placements if _converted_placement(placement, True) is None)
    return (f"to_dtensor: PyTorch's DTensor has no placement like {placement!r} (placements {dtensor.placements!r}); "
            f"redistribute to Shard/Replicate/Partial first, e.g. x.redistribute(placements=[Replicate()] * mesh.ndim)")


def _no_placement_here_error(tensor) -> str:
    placement = next(placement for placement in tensor.placements if _converted_placement(placement, False) is None)
    return (f"from_dtensor: the placement {placement!r} of this DTensor (placements {tensor.placements}) has no "
            f"counterpart here (Shard, Replicate and Partial do); redistribute it in torch to those first")


def _uneven_error(dtensor) -> str:
    layout: Layout = dtensor.sharding
    default = Layout.create(layout.mesh_shape, layout.placements, layout.shape)
    return (
        f"to_dtensor: PyTorch's DTensor holds torch.chunk shards only, and this DTensor of shape "
        f"{tuple(layout.shape)} with placements {layout.placements!r} has pieces {layout.pieces} (shard order "
        f"{layout.shard_order}) where torch.chunk gives {default.pieces} (order {default.shard_order}); move it to "
        f"torch.chunk's shards first: x.redistribute(placements=[Replicate()] * x.device_mesh.ndim)"
        f".redistribute(placements=x.placements)"
    )
