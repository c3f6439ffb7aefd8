"""The library's registry of torch.distributed process groups, for the world they belong to.

Groups are created once per distinct set of global ranks and shared by all meshes and sub-meshes
(c10d needs every rank of the world to create groups in one order). A mesh holds no group: it names
its groups by rank set (or by a token, for a group the user handed to `DeviceMesh.from_group`) and
looks them up here, so a mesh or DTensor the program still holds keeps no process group alive. This
state belongs to the process and its world, not to any one mesh, hence its own module below `mesh`.

A world is the default process group: after `destroy_process_group` and a new `init_process_group`,
the library forgets the old world's groups (and the caches registered with `on_new_world`), new
meshes get new groups and an old mesh raises a clear error when used. At interpreter exit the library
destroys the groups it created, then the default group if it initialized it, and drops every
reference it holds to a group (see `release_process_groups`).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import socket
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .rank_state import per_rank

__all__ = [
    "DEVICE_BACKENDS", "ensure_default_group", "group_for", "named_group", "has_group",
    "user_group_token", "world_generation", "on_new_world", "forget_worlds", "release_process_groups", "timeout_seconds",
]

# The backend of the groups a mesh of each device type runs over.
DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}

# One process group per distinct set of global ranks (sorted), shared by every mesh.
_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
# One-rank groups, made by their one member on demand (`_one_rank_group`), by rank.
_one_rank_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
# Groups the user handed to `DeviceMesh.from_group`, by a token the mesh keeps (a mesh holds no group).
_user_groups: dict[int, dist.ProcessGroup] = {}
_user_group_tokens = itertools.count()
# Every group this library created in the current world, oldest first (destroyed at exit).
_created_groups: list[dist.ProcessGroup] = []
# The default group the caches above belong to, and the number of the world it is (a new number at every
# change of world and at every release: a mesh built before is of an old world). Numbers come from one
# counter for the process, so that no two worlds share one, even worlds of ranks simulated in this process.
_world_group: dist.ProcessGroup | None = None
_generations = itertools.count(1)
_generation = 0
_library_default_group: dist.ProcessGroup | None = None  # the default group `ensure_default_group` made
_forget_callbacks: list[Callable[[], None]] = []
_exit_handler_registered = False


def timeout_seconds() -> float:
    """How long a rank waits for the others (`SHARDTENSOR_TIMEOUT`, 300 s by default)."""
    return float(os.environ.get("SHARDTENSOR_TIMEOUT", "300"))


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_seconds())


def ensure_default_group(device_type: str) -> None:
    """Initialize the default process group if needed: env:// under torchrun, else a world of 1."""
    global _library_default_group
    if dist.is_initialized():
        return
    _register_exit_handler()
    backend = DEVICE_BACKENDS[device_type]
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
        dist.init_process_group(backend, init_method="env://", timeout=_timeout())
    else:
        _init_world_of_one(backend)
    _library_default_group = dist.GroupMember.WORLD


def _init_world_of_one(backend: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=_timeout()
    )


def group_for(ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """The cached group over `ranks`; creates it (a collective call over the world) if new.

    The whole world maps to the default group. One-rank groups are not created here (that would
    cost a world-wide call for nothing): they are None until `DeviceMesh.get_group` asks for one.
    """
    key = tuple(sorted(ranks))
    if key in _groups:
        return _groups[key]
    if len(key) == dist.get_world_size():
        _groups[key] = dist.group.WORLD
    elif len(key) == 1:
        return None
    else:
        _groups[key] = _track(dist.new_group(list(key), timeout=_timeout()))
    return _groups[key]


def _one_rank_group(key: tuple[int]) -> dist.ProcessGroup:
    """The cached group of this one rank, made by it alone on first use. Only for one rank: torch names a
    group made by its members alone by hashing its ranks with the number of groups each member has been
    in, so members of a larger group that were in different groups would compute different names and hang."""
    if key not in _one_rank_groups:
        _one_rank_groups[key] = _track(dist.new_group(list(key), timeout=_timeout(), use_local_synchronization=True))
    return _one_rank_groups[key]


def named_group(key: tuple[int, ...], user_token: int | None) -> dist.ProcessGroup:
    """The group a mesh names for one mesh dim: the user's group of `user_token`, else the library's
    over the sorted ranks `key` (the world's, a one-rank group made on demand, or one `group_for` made)."""
    if user_token is not None:
        return _user_groups[user_token]
    if len(key) == dist.get_world_size():
        return dist.group.WORLD
    if len(key) == 1:  # a one-rank group, made on demand: only this rank takes part
        return _one_rank_group(key)
    return _groups[key]


def has_group(key: tuple[int, ...]) -> bool:
    """Whether `group_for` made (or mapped to the world) a group over the sorted ranks `key` in this world."""
    return key in _groups


def user_group_token(group: dist.ProcessGroup) -> int:
    """The token of a user's group, the same for the same group (so meshes over it compare equal)."""
    for token, known in _user_groups.items():
        if known is group:
            return token
    token = next(_user_group_tokens)
    _user_groups[token] = group
    return token


def _track(group):
    """Remember a group this library created (this rank is in it), to destroy it at exit."""
    _register_exit_handler()
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        _created_groups.append(group)
    return group


# --- the world the groups belong to ---------------------------------------------------------------
def world_generation() -> int:
    """A number that changes whenever the default process group does (destroy, then init again).

    On a change every cached group of the old world is forgotten, here and in the modules that
    registered with `on_new_world`. Costs one attribute read when nothing changed.
    """
    global _world_group, _generation
    world = dist.GroupMember.WORLD
    if world is not _world_group:
        _register_exit_handler()  # the library holds this world's groups from now on, made by it or not
        if _world_group is not None:
            _forget_groups()
            for forget in _forget_callbacks:
                forget()
        _world_group = world
        _generation = next(_generations)
    return _generation


def _forget_groups() -> None:
    for registry in (_groups, _one_rank_groups, _created_groups, _user_groups):
        registry.clear()


def on_new_world(forget: Callable[[], None]) -> None:
    """Call `forget()` whenever the default process group changes (to drop caches of the old world)."""
    _forget_callbacks.append(forget)


def release_process_groups() -> None:
    """Destroy the groups this library created, newest first, then the default group if it made it,
    and forget every group of this world (meshes built before raise a clear error when used).

    Runs at interpreter exit (and when a `spawn` worker stops). Destroying a group is local, no
    barrier, so ranks may exit in any order. c10d's destroy does not stop a gloo group's worker
    threads: only freeing the group does (its destructor joins them). A thread still alive when
    Python finalizes aborts the process ("terminate called without an active exception") when it
    drops the last collective's tensors and finds no interpreter. So the library also drops its own
    references here (registry, caches); a mesh holds no group, only its rank sets. Groups the user
    made are not destroyed; so is a world that changed since.
    """
    global _world_group, _library_default_group, _generation
    world = dist.GroupMember.WORLD
    if world is not None and world is _world_group:
        for group in reversed(_created_groups):
            try:
                dist.destroy_process_group(group)
            except ValueError:  # the user destroyed it already
                pass
        if world is _library_default_group:
            dist.destroy_process_group()
    _forget_groups()
    for forget in _forget_callbacks:
        forget()
    _world_group = None
    _library_default_group = None
    _generation = next(_generations)


def _save_rank_state() -> tuple:
    return _groups, _one_rank_groups, _user_groups, _created_groups, _world_group, _generation, _library_default_group


def _restore_rank_state(state: tuple) -> None:
    global _groups, _one_rank_groups, _user_groups, _created_groups, _world_group, _generation, _library_default_group
    _groups, _one_rank_groups, _user_groups, _created_groups, _world_group, _generation, _library_default_group = state


per_rank("process_groups", _save_rank_state, _restore_rank_state, lambda: ({}, {}, {}, [], None, 0, None))


def forget_worlds() -> None:
    """Drop the caches of every world (`on_new_world`): `launch.simulate` calls it when its worlds end."""
    for forget in _forget_callbacks:
        forget()


def _register_exit_handler() -> None:
    """Register `release_process_groups` at exit once, when the library first holds a group: creates
    one, or caches the user's (a mesh in a world the program initialized itself, whose groups
    `_world_group` and the peers cache then keep alive even after the program destroys them)."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(release_process_groups)
        _exit_handler_registered = True
