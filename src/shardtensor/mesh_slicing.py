"""Naming and slicing a `DeviceMesh`: mesh dims by name, sub-meshes (`mesh["tp"]`), `_flatten`, `_unflatten`.

`MeshSlicing` is a base of `DeviceMesh` (mesh.py): a sub-mesh remembers the root mesh it was sliced or
flattened from and, per mesh dim, the root dims it spans, so that slicing a slice, or naming a flattened
dim, finds its ranks and groups through the root. Flattening and unflattening create the new dims' process
groups for every rank's line in the same order on every rank (collective, as building a mesh is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Self

import torch

from .process_groups import group_for


class MeshSlicing:
    """The naming and slicing methods of `DeviceMesh` (its base): they read the mesh's ranks, names,
    coordinate, root and root dims, and build sub-meshes as `type(self)(...)`."""

    def _mesh_dim_index(self, mesh_dim: int | str | None, needed_for: str | None = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"{needed_for or 'this call'} needs a mesh_dim on a {self.ndim}-D mesh {self!r}; "
                    f"pass an int in [0, {self.ndim}) or one of the names {self.mesh_dim_names}"
                )
            return 0
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise _unknown_name_error(self, mesh_dim)
            return self.mesh_dim_names.index(mesh_dim)
        if isinstance(mesh_dim, int) and -self.ndim <= mesh_dim < self.ndim:
            return mesh_dim % self.ndim
        raise IndexError(f"mesh_dim {mesh_dim!r} is out of range for the {self.ndim}-D mesh {self!r}")

    def __getitem__(self, names: str | tuple[str, ...]) -> Self:
        """The sub-mesh over the named mesh dims (in the order given) through this rank; a name may also
        be one that `_flatten` gave to some of the root mesh's dims that this mesh spans."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names or not all(isinstance(name, str) for name in names):
            raise TypeError(f"slice a DeviceMesh by mesh dim names, e.g. mesh['tp'] or mesh['dp', 'tp']; got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh dim names {names} repeat a name; name each mesh dim once")
        root = self._root or self
        spans = [self._root_dims_of(name, root) for name in names]
        used = [root_dim for span in spans for root_dim in span]
        if len(set(used)) != len(used):
            raise ValueError(f"mesh dims {names} of {self!r} overlap (a flattened dim holds another); name disjoint dims")
        if self._coordinate is None:
            raise _not_in_mesh_error(self, "slicing")
        self.check_world("slicing")
        return root._slice(names, tuple(spans))

    def _root_dims_of(self, name: str, root: MeshSlicing) -> tuple[int, ...]:
        """The dims of `root` that the mesh dim `name` of this mesh spans (its own, or flattened from the root)."""
        if self.mesh_dim_names is not None and name in self.mesh_dim_names:
            return self._root_dims[self.mesh_dim_names.index(name)]
        span = root._flattened.get(name)
        if span is None or not set(span) <= self._spanned_root_dims():
            raise _unknown_name_error(self, name)
        return span

    def _spanned_root_dims(self) -> set[int]:
        return {root_dim for dims in self._root_dims for root_dim in dims}

    def _slice(self, names: tuple[str, ...], spans: tuple[tuple[int, ...], ...]) -> Self:
        """This (root) mesh's sub-mesh through this rank whose mesh dim i spans the root dims `spans[i]`
        (flattened, in order): its groups exist, made by `__init__` or `_flatten`."""
        kept = [root_dim for span in spans for root_dim in span]
        index = [slice(None) if root_dim in kept else self._coordinate[root_dim] for root_dim in range(self.ndim)]
        remaining = [root_dim for root_dim in range(self.ndim) if root_dim in kept]
        sub_ranks = self.mesh[tuple(index)].permute([remaining.index(root_dim) for root_dim in kept])
        sub_ranks = sub_ranks.reshape([math.prod(self.mesh.shape[root_dim] for root_dim in span) for span in spans])
        tokens = tuple(self._group_tokens[span[0]] if len(span) == 1 else None for span in spans)
        sliced_from_world = self._sliced_from_world or self._spans_world
        return type(self)(self.device_type, sub_ranks, mesh_dim_names=names, _groups_exist=True, _user_group_tokens=tokens,
                          _sliced_from_world=sliced_from_world, _root=self, _root_dims=spans)

    def _flatten(self, mesh_dim_name: str | None = None) -> Self:
        """This mesh's ranks as a 1-D mesh named `mesh_dim_name` (default: the mesh dim names joined by
        "_"), as torch's `DeviceMesh._flatten`: `mesh_3d["dp", "cp"]._flatten()` on a dp x cp x tp mesh is
        the dp_cp mesh through this rank, and afterwards `mesh_3d["dp_cp"]` and `mesh_3d["dp_cp", "tp"]`
        slice it like any mesh dim. Collective (it creates the flattened groups of every tp line, in the
        same order on every rank), like building a mesh; flattening the same dims under the same name
        again returns the same mesh without creating anything."""
        if self.mesh_dim_names is None:
            raise RuntimeError(f"cannot flatten {self!r}: it has no mesh_dim_names, which the flattened dim is named from; "
                               "build the mesh with mesh_dim_names=(...)")
        name = mesh_dim_name or "_".join(self.mesh_dim_names)
        if not isinstance(name, str):
            raise TypeError(f"_flatten: mesh_dim_name must be a string, got {name!r}")
        if self.ndim == 1 and name in self.mesh_dim_names:
            return self
        root = self._root or self
        span = tuple(root_dim for dims in self._root_dims for root_dim in dims)
        if root.mesh_dim_names is not None and name in root.mesh_dim_names:
            raise ValueError(f"_flatten: {name!r} already names a mesh dim of {root!r}; give the flattened dim another "
                             f"name (taken: {root.mesh_dim_names + tuple(root._flattened)})")
        known = root._flattened.get(name)
        if known is None:
            self._create_flattened_groups(range(self.ndim))
            root._flattened[name] = span
        elif known != span:
            raise ValueError(f"_flatten: {name!r} already names the flattened root dims {known} of {root!r}, not {span}; "
                             "give these dims another name")
        return root[name] if self._coordinate is not None else self._outside_flattened(name)

    def _unflatten(self, dim: int | str, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str]) -> Self:
        """This mesh with mesh dim `dim` split into mesh dims of `mesh_sizes` named `mesh_dim_names`, as
        torch's `DeviceMesh._unflatten`: `init_device_mesh("cpu", (8,), mesh_dim_names=("world",))._unflatten(
        0, (2, 2, 2), ("dp", "cp", "tp"))` is the 2x2x2 mesh. Collective (it creates the new mesh dims' groups
        for this mesh and for every mesh sliced like it on the other ranks, in the same order on every rank).
        The result is a mesh of its own: slice and flatten it, not this one, for the new names."""
        mesh_dim = self._mesh_dim_index(dim, needed_for="_unflatten")
        sizes, names = tuple(int(size) for size in mesh_sizes), tuple(mesh_dim_names)
        if len(sizes) != len(names) or math.prod(sizes) != self.mesh.shape[mesh_dim] or min(sizes, default=0) < 1:
            raise ValueError(f"_unflatten: mesh dim {dim!r} of {self!r} has {self.mesh.shape[mesh_dim]} ranks; give "
                             f"positive mesh_sizes whose product is that and one name per size, got {sizes} and {names}")
        if self.mesh_dim_names is None and self.ndim > 1:
            raise RuntimeError(f"_unflatten: {self!r} has no mesh_dim_names to name its other mesh dims by; build it "
                               "with mesh_dim_names=(...)")
        old_names = self.mesh_dim_names or ("",)
        new_names = old_names[:mesh_dim] + names + old_names[mesh_dim + 1:]
        _check_names(new_names, len(new_names))
        shape = self.shape[:mesh_dim] + sizes + self.shape[mesh_dim + 1:]
        self._create_split_groups(mesh_dim, sizes)
        tokens = self._group_tokens[:mesh_dim] + (None,) * len(sizes) + self._group_tokens[mesh_dim + 1:]
        sliced_from_world = self._sliced_from_world or self._spans_world
        return type(self)(self.device_type, self.mesh.reshape(shape), mesh_dim_names=new_names, _groups_exist=True,
                          _user_group_tokens=tokens, _sliced_from_world=sliced_from_world)

    def _create_flattened_groups(self, mesh_dims) -> None:
        """Create the groups over `mesh_dims` flattened (in that order) for this mesh and for every mesh
        sliced like it on the other ranks (enumerated through the root mesh), in the same order on every
        rank: collective, like building a mesh. Groups that exist are not made again."""
        root = self._root or self
        span = tuple(root_dim for mesh_dim in mesh_dims for root_dim in self._root_dims[mesh_dim])
        for line in _rank_lines_over(root.mesh, span):
            group_for(line)

    def _create_split_groups(self, mesh_dim: int, sizes: tuple[int, ...]) -> None:
        """Create the groups of mesh dim `mesh_dim` split into mesh dims of `sizes`, for this mesh and for
        every mesh sliced like it on the other ranks (enumerated through the root mesh), in the same order
        on every rank: collective, like building a mesh. Groups that exist are not made again."""
        shape = self.shape[:mesh_dim] + tuple(sizes) + self.shape[mesh_dim + 1:]
        root = self._root or self
        others = [root_dim for root_dim in range(root.ndim) if root_dim not in self._spanned_root_dims()]
        order = others + [root_dim for span in self._root_dims for root_dim in span]
        for sibling in root.mesh.permute(order).reshape(-1, *shape):
            for new_dim in range(mesh_dim, mesh_dim + len(sizes)):
                for line in _rank_lines_over(sibling, (new_dim,)):
                    group_for(line)

    def _outside_flattened(self, name: str) -> Self:
        """What `_flatten` returns on a rank outside the mesh: the flattened ranks of the mesh itself (a
        rank outside has no line of its own to flatten)."""
        return type(self)(self.device_type, self.mesh.flatten(), mesh_dim_names=(name,), _groups_exist=True, _root=self,
                          _root_dims=(tuple(range(self.ndim)),))


def _rank_lines_over(mesh: torch.Tensor, mesh_dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every set of ranks spanning `mesh_dims` (flattened in that order), other coordinates in row-major order."""
    others = [mesh_dim for mesh_dim in range(mesh.ndim) if mesh_dim not in mesh_dims]
    lines = mesh.permute(others + list(mesh_dims)).reshape(-1, math.prod(mesh.shape[mesh_dim] for mesh_dim in mesh_dims))
    return [tuple(line) for line in lines.tolist()]


def _check_names(names: tuple[str, ...] | None, ndim: int) -> None:
    if names is None:
        return
    if len(names) != ndim:
        raise ValueError(
            f"mesh_dim_names {names} has {len(names)} names but the mesh has {ndim} mesh dims; "
            "give one name per mesh dim"
        )
    if not all(isinstance(name, str) and name for name in names):
        raise TypeError(f"mesh_dim_names must be non-empty strings, got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names {names} repeat a name; every mesh dim needs its own name")


def _unknown_name_error(mesh: MeshSlicing, name: str) -> KeyError:
    if mesh.mesh_dim_names is None:
        hint = "this mesh has no mesh_dim_names; build it with mesh_dim_names=(...) or use int mesh dims"
    else:
        root = mesh._root or mesh
        flattened = tuple(name for name, span in root._flattened.items() if set(span) <= mesh._spanned_root_dims())
        hint = f"known names: {mesh.mesh_dim_names}" + (f", and flattened (`_flatten`): {flattened}" if flattened else "")
    return KeyError(f"mesh dim name {name!r} is not in {mesh!r}; {hint}")


def _not_in_mesh_error(mesh: MeshSlicing, what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} needs this rank ({mesh.get_rank()}) to be in the mesh, but {mesh!r} does not hold it; "
        "check mesh.get_coordinate() is not None before using the mesh on this rank"
    )
