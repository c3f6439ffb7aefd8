"""`DeviceMesh`: an n-d array of global ranks over torch.distributed process groups.

A mesh dim (`mesh_dim`, an int or a name) is an axis of that array; a rank's `coordinate` is its
position in it. For every mesh dim the mesh names the process group of the ranks that share this
rank's coordinate on the other mesh dims. The groups themselves live in the library's registry
(`process_groups`): a mesh keeps only their rank sets, so holding a mesh keeps no group alive.

A mesh belongs to the world (default process group) it was built in: after `destroy_process_group`
and a new `init_process_group`, an old mesh raises a clear error when used. Meshes pickle as their
ranks and names, and unpickle over the groups this process already has.

    >>> mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))  # doctest: +SKIP
    >>> mesh["tp"].get_local_rank(), mesh.get_coordinate()  # doctest: +SKIP
    (0, [0])
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .graph_constants import MemberType, register_graph_constant
from .process_groups import (
    DEVICE_BACKENDS,
    ensure_default_group,
    group_for,
    has_group,
    named_group,
    user_group_token,
    world_generation,
)
from .mesh_slicing import MeshSlicing, _check_names, _not_in_mesh_error, _rank_lines_over

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh"]


class _MeshStack(threading.local):
    """The `with mesh:` stack of the current thread; `current_mesh()` returns its innermost entry."""

    def __init__(self):
        self.meshes: list[DeviceMesh] = []


_mesh_stack = _MeshStack()


def _device_type_error(device_type) -> ValueError:
    return ValueError(
        f"device_type {device_type!r} is not supported; use one of {sorted(DEVICE_BACKENDS)} "
        "(the backend follows: gloo for 'cpu', nccl for 'cuda')"
    )


class DeviceMesh(MeshSlicing):
    """An n-d mesh of global ranks with one process group per mesh dim (for this rank's line).

    Building a mesh is collective: every rank of the world must build it, in the same order as
    other meshes, because it may create process groups. Naming and slicing (`mesh["tp"]`, `_flatten`,
    `_unflatten`) come from its base `MeshSlicing` (mesh_slicing.py).
    """

    def __init__(self, device_type: str, mesh, *, mesh_dim_names: tuple[str, ...] | None = None, _groups_exist=False,
                 _user_group_tokens: tuple[int | None, ...] | None = None, _sliced_from_world: bool = False,
                 _root: DeviceMesh | None = None, _root_dims: tuple[tuple[int, ...], ...] | None = None):
        if device_type not in DEVICE_BACKENDS:
            raise _device_type_error(device_type)
        ranks = torch.as_tensor(mesh, dtype=torch.int64, device="cpu").detach().clone()
        if ranks.ndim == 0 or ranks.numel() == 0:
            raise ValueError(f"a DeviceMesh needs at least one rank in at least one dim, got mesh {mesh!r}")
        flat = ranks.flatten().tolist()
        if len(set(flat)) != len(flat):
            raise ValueError(f"mesh {ranks.tolist()} lists a rank more than once; every rank may appear once")
        names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        _check_names(names, ranks.ndim)
        ensure_default_group(device_type)
        world_size = dist.get_world_size()
        if min(flat) < 0 or max(flat) >= world_size:
            raise ValueError(
                f"mesh {ranks.tolist()} holds ranks outside the world of {world_size} ranks "
                f"(allowed: 0..{world_size - 1})"
            )
        self._device_type = device_type
        self._mesh = ranks
        self._mesh_dim_names = names
        for name in _CACHED_READS:  # held in the instance dict from now on (see `_CACHED_READS`)
            getattr(self, name)
        self._rank = dist.get_rank()
        self._generation = world_generation()
        position = (ranks == self._rank).nonzero()
        self._coordinate = None if position.numel() == 0 else [int(c) for c in position[0].tolist()]
        # Per mesh dim, the token of the user's group (`from_group`), or None for the library's group.
        self._group_tokens = _user_group_tokens or (None,) * ranks.ndim
        self._flat_ranks = tuple(flat)  # compared by `__eq__` without a tensor op (none may run under a fake mode)
        self._hash = hash((device_type, self._flat_ranks, tuple(ranks.shape), names, self._generation, self._group_tokens))
        self._trace_key = next(_trace_keys)
        _meshes_by_trace_key[self._trace_key] = self
        # Sliced (`mesh["tp"]`) from a mesh over the whole world, maybe through other slices: every rank of
        # the world is in this mesh or in a sibling it sliced for itself (`sub_mesh` reads this).
        self._sliced_from_world = _sliced_from_world
        # Every rank of the world is in this mesh, so all of them can make its groups together (`comm`'s
        # flattened groups) and none runs its ops from outside (`sub_mesh`).
        self._spans_world = len(flat) == world_size
        # The mesh this one was sliced or flattened from (None: itself), and per mesh dim the dims of that
        # root it spans (one for a sliced dim, several for a flattened one); a root also keeps the mesh dims
        # flattened from it by name (`_flatten`), which slicing it accepts like its own names.
        self._root = _root
        self._root_dims = _root_dims or tuple((mesh_dim,) for mesh_dim in range(ranks.ndim))
        self._flattened: dict[str, tuple[int, ...]] = {}
        if not _groups_exist:
            for mesh_dim in range(ranks.ndim):
                self._create_groups(mesh_dim)
        self._group_ranks = [self._line_through_me(mesh_dim) for mesh_dim in range(ranks.ndim)]
        # This rank's group per mesh dim, named by its sorted ranks (None outside the mesh): the registry
        # owns the groups, so that releasing them frees them (`process_groups.release_process_groups`).
        self._group_keys = [None if line is None else tuple(sorted(line)) for line in self._group_ranks]

    def _create_groups(self, mesh_dim: int) -> None:
        """Create all groups along `mesh_dim`, in the same order on every rank."""
        for line in _rank_lines_over(self.mesh, (mesh_dim,)):
            group_for(line)

    def _line_through_me(self, mesh_dim: int) -> tuple[int, ...] | None:
        return _line_through(self.mesh, self._coordinate, mesh_dim)

    # --- shape and coordinates ---------------------------------------------------------------
    # Cached properties, filled at construction: torch.compile (2.13) reads an opaque object's instance
    # attributes, but fails on its properties (dynamo's opaque-object variable has no class source).
    @functools.cached_property
    def device_type(self) -> str:
        return self._device_type

    @functools.cached_property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._mesh_dim_names

    @functools.cached_property
    def ndim(self) -> int:
        return self._mesh.ndim

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._mesh.shape)

    @property
    def mesh(self) -> torch.Tensor:
        """The global ranks, an int64 cpu tensor of the mesh's shape."""
        return self._mesh

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks along `mesh_dim`, or in the whole mesh when None."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self._mesh_dim_index(mesh_dim)]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate in the mesh, or None when the rank is not in the mesh."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's coordinate along `mesh_dim` (may be None only for a 1-D mesh)."""
        mesh_dim = self._mesh_dim_index(mesh_dim, needed_for="get_local_rank")
        if self._coordinate is None:
            raise _not_in_mesh_error(self, "get_local_rank")
        return self._coordinate[mesh_dim]

    def group_ranks(self, mesh_dim: int | str) -> tuple[int, ...]:
        """Global ranks along `mesh_dim` through this rank's coordinate, in coordinate order."""
        ranks = self._group_ranks[self._mesh_dim_index(mesh_dim)]
        if ranks is None:
            raise _not_in_mesh_error(self, "group_ranks")
        return ranks

    # --- process groups ------------------------------------------------------------------------
    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """The process group along `mesh_dim` through this rank (may be None only for a 1-D mesh); a name
        `_flatten` gave to dims of the root mesh gives the flattened group, as in torch."""
        if isinstance(mesh_dim, str) and mesh_dim not in (self.mesh_dim_names or ()) and mesh_dim in (self._root or self)._flattened:
            return self[mesh_dim].get_group()
        mesh_dim = self._mesh_dim_index(mesh_dim, needed_for="get_group")
        if self._coordinate is None:
            raise _not_in_mesh_error(self, "get_group")
        self.check_world("get_group")
        return named_group(self._group_keys[mesh_dim], self._group_tokens[mesh_dim])

    def check_world(self, what: object) -> None:
        """Raise a clear error when the world this mesh was built in has been destroyed since."""
        if self._generation != world_generation():
            raise _old_world_error(self, what)

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        """The process group of every mesh dim, in mesh-dim order."""
        return [self.get_group(mesh_dim) for mesh_dim in range(self.ndim)]

    @staticmethod
    def from_group(group, device_type: str, mesh=None, *, mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
        """A mesh whose collectives along each mesh dim run over the user's existing process group.

        One group gives a 1-D mesh over its ranks in group-rank order (`mesh`, if given, must list them
        in that order). A list of groups, one per mesh dim, needs `mesh` and `mesh_dim_names`, and each
        group must hold exactly the ranks of this rank's line along its mesh dim. Creates no group, so
        it is not collective. Such a mesh equals no mesh built otherwise; a collective over a tuple of
        mesh dims runs over a flattened group the library creates when the mesh spans the world (every
        rank makes it), else as one collective per mesh dim over the user's groups (see `comm`).

        >>> tp = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu", mesh_dim_names=("tp",))  # doctest: +SKIP
        """
        if isinstance(group, dist.ProcessGroup):
            group_ranks = dist.get_process_group_ranks(group)
            given = None if mesh is None else torch.as_tensor(mesh, dtype=torch.int64, device="cpu").tolist()
            if given is not None and given != group_ranks:
                raise ValueError(
                    f"from_group: mesh {given} does not list the group's ranks {group_ranks} "
                    "in group-rank order; pass mesh=None (the mesh is then the group's ranks) or that list"
                )
            groups, mesh = [group], group_ranks
        elif isinstance(group, Sequence) and group and all(isinstance(item, dist.ProcessGroup) for item in group):
            groups = list(group)
            if mesh is None or mesh_dim_names is None:
                raise ValueError(
                    f"from_group: {len(groups)} process groups need the mesh (one mesh dim per group, global "
                    "ranks) and mesh_dim_names, e.g. from_group([dp, tp], 'cpu', [[0, 1], [2, 3]], "
                    "mesh_dim_names=('dp', 'tp'))"
                )
        else:
            raise TypeError(
                f"from_group takes a ProcessGroup or a non-empty list of them, got {group!r} (dist.new_group "
                "returns GroupMember.NON_GROUP_MEMBER on a rank that is not a member: this rank is not a member "
                "of such a group; give each rank the groups that hold it)"
            )
        shape_only = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _groups_exist=True)
        if shape_only.ndim != len(groups):
            raise ValueError(
                f"from_group: mesh {shape_only.mesh.tolist()} has {shape_only.ndim} mesh dims but "
                f"{len(groups)} process groups were given; pass one group per mesh dim"
            )
        if shape_only.get_coordinate() is not None:
            for mesh_dim, user_group in enumerate(groups):
                _check_group_ranks(shape_only, mesh_dim, user_group)
        tokens = tuple(user_group_token(user_group) for user_group in groups)
        return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _groups_exist=True, _user_group_tokens=tokens)

    # --- current-mesh stack, identity ------------------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        _mesh_stack.meshes.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _mesh_stack.meshes.pop()

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh) or self._hash != other._hash:
            return False
        return (
            self.device_type == other.device_type
            and self._generation == other._generation
            and self.mesh_dim_names == other.mesh_dim_names
            and self._group_tokens == other._group_tokens
            and self.shape == other.shape
            and self._flat_ranks == other._flat_ranks
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = "" if self.mesh_dim_names is None else f", mesh_dim_names={self.mesh_dim_names!r}"
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    def __fx_repr__(self):
        """How a compiled graph's code names this mesh (a constant of the graph, as a value): by a key
        that finds it in this process (docs/compile.md)."""
        return f"mesh_by_trace_key({self._trace_key})", {"mesh_by_trace_key": mesh_by_trace_key}

    # --- pickling ----------------------------------------------------------------------------------
    def __reduce__(self):
        """Pickle (and `torch.save`, `copy.deepcopy`) the ranks, names and world size, not the process
        groups: unpickling re-attaches the groups this process already has for the same world."""
        return (_rebuild_mesh, (self.device_type, self.mesh.tolist(), self.mesh_dim_names, dist.get_world_size()))


def _line_through(mesh: torch.Tensor, coordinate: Sequence[int] | None, mesh_dim: int) -> tuple[int, ...] | None:
    """Global ranks along `mesh_dim` through `coordinate` (None for a rank outside the mesh)."""
    if coordinate is None:
        return None
    index = list(coordinate)
    index[mesh_dim] = slice(None)
    return tuple(mesh[tuple(index)].tolist())


def _rebuild_mesh(device_type: str, ranks: list, mesh_dim_names: tuple[str, ...] | None, world_size: int) -> DeviceMesh:
    """Unpickle a mesh: the same ranks over the process groups this process already has.

    No group is created here (that would be a collective the other ranks may not be in): build the
    mesh once in this process first (`init_device_mesh`), as a program does before loading.
    """
    if not dist.is_initialized() and world_size == 1:
        ensure_default_group(device_type)
    current_size = dist.get_world_size() if dist.is_initialized() else None
    if current_size != world_size:
        raise _other_world_error(ranks, world_size, current_size)
    world_generation()  # forget the groups of a destroyed world before looking them up
    rank = dist.get_rank()
    mesh = torch.tensor(ranks, dtype=torch.int64, device="cpu")
    position = (mesh == rank).nonzero()
    coordinate = None if position.numel() == 0 else position[0].tolist()
    for mesh_dim in range(mesh.ndim):
        line = _line_through(mesh, coordinate, mesh_dim)  # None outside the mesh: no group
        # The world's group always exists; a one-rank group is made on demand (get_group).
        if line is not None and 1 < len(line) < world_size and not has_group(tuple(sorted(line))):
            raise _missing_group_error(ranks, tuple(sorted(line)))
    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _groups_exist=True)


torch.serialization.add_safe_globals([_rebuild_mesh])  # `torch.load` (weights_only) may rebuild meshes


def _other_world_error(ranks: list, world_size: int, current_size: int | None) -> RuntimeError:
    here = "torch.distributed is not initialized" if current_size is None else f"this world has {current_size} ranks"
    return RuntimeError(
        f"cannot unpickle DeviceMesh {ranks}: it was saved in a world of {world_size} ranks, but {here}. "
        f"A pickled mesh (and a pickled DTensor) only loads inside a world of the same size, where its "
        f"process groups exist; to move a DTensor to another world or layout, save it with "
        f"torch.distributed.checkpoint (docs/checkpoint.md), which reshards on load"
    )


def _missing_group_error(ranks: list, key: tuple[int, ...]) -> RuntimeError:
    return RuntimeError(
        f"cannot unpickle DeviceMesh {ranks}: this process has no process group over ranks {list(key)} "
        f"yet, and unpickling creates none (that would be a collective other ranks are not in). Build "
        f"the mesh first on every rank, e.g. init_device_mesh(...) with the shape it was sliced from, "
        f"then load"
    )


def _check_group_ranks(mesh: DeviceMesh, mesh_dim: int, group: dist.ProcessGroup) -> None:
    """Raise when `group` is not the set of ranks along `mesh_dim` through this rank."""
    line = mesh.group_ranks(mesh_dim)
    group_ranks = dist.get_process_group_ranks(group)
    if sorted(group_ranks) != sorted(line):
        raise ValueError(
            f"from_group: the process group for mesh dim {mesh_dim} holds ranks {group_ranks}, but on rank "
            f"{mesh.get_rank()} mesh {mesh.mesh.tolist()} has ranks {list(line)} along mesh dim {mesh_dim}; "
            "give each rank the group of its own line along that mesh dim (e.g. the tp group holding it)"
        )


def _old_world_error(mesh: DeviceMesh, what: object) -> RuntimeError:
    return RuntimeError(
        f"{what}: {mesh!r} belongs to a process-group world that was destroyed (destroy_process_group, "
        "or the library released its groups: shardtensor.process_groups.release_process_groups); "
        "its groups are gone. Build a new mesh in the current world (init_device_mesh) and distribute "
        "the data again (distribute_tensor, or from_local of the local tensors saved before)"
    )


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """A mesh of all ranks, `arange(world_size).view(mesh_shape)`; sets up the world if needed.

    >>> init_device_mesh("cpu", (1,)).shape  # doctest: +SKIP
    (1,)
    """
    if device_type not in DEVICE_BACKENDS:
        raise _device_type_error(device_type)
    mesh_shape = tuple(int(size) for size in mesh_shape)
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    _check_names(names, len(mesh_shape))
    ensure_default_group(device_type)
    world_size = dist.get_world_size()
    if math.prod(mesh_shape) != world_size:
        raise ValueError(
            f"mesh_shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but the world has {world_size}; "
            f"choose a shape whose sizes multiply to {world_size}"
        )
    ranks = torch.arange(world_size, dtype=torch.int64, device="cpu").view(mesh_shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=names)


_CACHED_READS = ("device_type", "mesh_dim_names", "ndim", "shape")

# Every mesh of this process by its trace key: a compiled graph's code refers to its meshes this way.
_trace_keys = itertools.count()
_meshes_by_trace_key: weakref.WeakValueDictionary[int, DeviceMesh] = weakref.WeakValueDictionary()


def mesh_by_trace_key(key: int) -> DeviceMesh:
    """The mesh a compiled graph names by `key` (`DeviceMesh.__fx_repr__`)."""
    return _meshes_by_trace_key[key]


# torch.compile holds a mesh in a graph as an opaque value: compared with `==` (guards), hashed, and
# written into the graph's code by `__fx_repr__`. Value-equal meshes are interchangeable here.
# Its read-only members are read on the real mesh while tracing and their results become constants.
register_graph_constant(DeviceMesh, members={
    name: MemberType.USE_REAL for name in (
        "device_type", "mesh_dim_names", "ndim", "shape", "size", "get_rank", "get_coordinate", "get_local_rank",
        "group_ranks", "__getitem__", "__eq__", "__ne__", "__hash__", "__repr__", "_spans_world",
        "_sliced_from_world", "_mesh_dim_index",
    )
})


def world_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh of every rank of the world over the default group, creating no group (so not a
    collective): for the exchanges every rank takes part in whatever mesh a call is on (the random
    seed, a sub-mesh's data-dependent output shapes)."""
    return DeviceMesh(device_type, list(range(dist.get_world_size())), _groups_exist=True)


def current_mesh() -> DeviceMesh:
    """The innermost mesh entered with `with mesh:` in this thread (each thread has its own stack)."""
    if not _mesh_stack.meshes:
        raise RuntimeError("no current mesh: enter one with `with mesh:` or pass a mesh explicitly")
    return _mesh_stack.meshes[-1]

