"""`@spmd`: a test body that runs on every rank of a local gloo world, once per mesh shape.

    @spmd(meshes=[(2,), (2, 2)])
    def test_sum(mesh):
        assert comm.all_reduce(torch.ones(1), mesh, 0, reduce_op="sum").item() == mesh.size(0)

The pytest side runs the body on a session-wide pool of `LocalWorkers` per world size (see
conftest.py); the worker imports the test module, finds the body in `shardtensor.launch`'s registry
and calls it with a mesh built by `init_device_mesh("cpu", shape)` (cached per shape per worker).
Meshes listed in `simulated=` (ids `simulated=4x4x4`) run on ranks simulated in the pytest process
(`launch.simulate`): no worker processes, so 8 to 64 ranks cost about what a real 4-rank run does.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import pytest
from hypothesis import HealthCheck, given, settings

from shardtensor import launch
from shardtensor.mesh import DeviceMesh, init_device_mesh

DEFAULT_MESHES = ((1,), (2,), (4,), (2, 2))
DEFAULT_TIMEOUT = 60.0

_worker_meshes: dict[tuple[int, ...], DeviceMesh] = {}


class Simulated(tuple):
    """A mesh shape whose ranks `launch.simulate` runs in the pytest process (no worker pool)."""


def mesh_id(shape) -> str:
    return ("simulated=" if isinstance(shape, Simulated) else "mesh=") + "x".join(str(size) for size in shape)


def _run_body(body: launch.RegisteredFunction, mesh_shape: tuple[int, ...], params: dict):
    """Worker side: build (or reuse) the mesh and run the registered body on it."""
    if mesh_shape not in _worker_meshes:
        _worker_meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
    return body.resolve()(mesh=_worker_meshes[mesh_shape], **params)


class WorkerPools:
    """One `LocalWorkers` per world size, started on first use and kept for the session."""

    def __init__(self, world_sizes: set[int] | None = None):
        self._pools: dict[int, launch.LocalWorkers] = {}
        self._expected = set(world_sizes or ())

    def get(self, world_size: int) -> launch.LocalWorkers:
        if world_size not in self._pools:
            for size in sorted(self._expected | {world_size}):  # start every expected pool at once
                if size not in self._pools:
                    self._pools[size] = launch.LocalWorkers(size, timeout=DEFAULT_TIMEOUT)
                    self._pools[size].start()
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def draw_examples(strategy, count: int) -> list:
    """`count` examples of a hypothesis `strategy`, drawn on the pytest side and sent to the ranks as
    plain data. Derandomized (the same examples on every run and machine), so a failure replays."""
    drawn = []

    @settings(max_examples=count, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        drawn.append(example)

    collect()
    return drawn


@contextlib.contextmanager
def example_note(mesh, example):
    """Name the mesh and the drawn example on any exception raised inside (a note on the traceback)."""
    try:
        yield
    except BaseException as error:
        error.add_note(f"mesh {tuple(mesh.shape)} ranks {mesh.mesh.tolist()}, example {example!r}")
        raise


def _run_simulated_body(body, mesh_shape: tuple[int, ...], params: dict):
    """A simulated rank's side: a mesh of its simulated world, then the body."""
    return body(mesh=init_device_mesh("cpu", mesh_shape), **params)


def spmd(meshes=DEFAULT_MESHES, *, timeout: float = DEFAULT_TIMEOUT, simulated=()):
    """Turn `def test_x(mesh, ...)` into a pytest test parametrized over mesh shapes (ids `mesh=2x2`):
    `meshes` on the worker pools' gloo ranks, `simulated` on ranks simulated in this process."""
    meshes = [tuple(shape) for shape in meshes] + [Simulated(shape) for shape in simulated]

    def decorate(body):
        reference = launch.register(body)
        body_parameters = [name for name in inspect.signature(body).parameters if name != "mesh"]
        if "monkeypatch" in body_parameters:  # pickled to the ranks, where nothing would ever undo its patches
            raise TypeError(f"{body.__name__}: an spmd body runs on the worker ranks, where pytest's monkeypatch "
                            "fixture is never undone; patch inside the body with pytest.MonkeyPatch.context()")

        def test(mesh, spmd_pools, **params):
            try:
                if isinstance(mesh, Simulated):
                    launch.simulate(_run_simulated_body, math.prod(mesh), body, tuple(mesh), params)
                else:
                    spmd_pools.get(math.prod(mesh)).run(_run_body, reference, mesh, params, timeout=timeout)
            except launch.RankFailure as failure:
                message = str(failure)
            else:
                return
            pytest.fail(message, pytrace=False)

        parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                      for name in ["mesh", "spmd_pools", *body_parameters]]
        test.__signature__ = inspect.Signature(parameters)
        test.__name__, test.__qualname__ = body.__name__, body.__qualname__
        test.__module__, test.__doc__ = body.__module__, body.__doc__
        test.spmd_meshes = meshes
        return pytest.mark.parametrize("mesh", meshes, ids=[mesh_id(shape) for shape in meshes])(test)

    return decorate
