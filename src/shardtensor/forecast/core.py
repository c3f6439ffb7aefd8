"""`forecast`: run a training step as one rank of a world of any size, with shapes and no data, and report
its collectives per mesh dim, their modeled time and the rank's peak memory.

    >>> def make_step(mesh):  # doctest: +SKIP
    ...     model = fully_shard(nn.Linear(4096, 4096), mesh=mesh)
    ...     optimizer = torch.optim.AdamW(model.parameters())
    ...     def step():
    ...         model(torch.randn(8, 4096)).sum().backward()
    ...         optimizer.step(); optimizer.zero_grad()
    ...     return step
    >>> print(forecast(make_step, (1024,), mesh_dim_names=("dp",)))  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import comm
from ..comm import CommRecord
from .fake_world import fake_world
from .memory import CATEGORIES
from .profiles import INTER_NODE, INTRA_NODE, HardwareProfile, profile_named

__all__ = ["forecast", "Forecast", "CollectiveForecast", "link_class", "price"]


@dataclass(frozen=True, slots=True)
class CollectiveForecast:
    """One collective this rank issues in the step: what, over which mesh dims, bytes, link and time."""

    kind: str
    mesh_dims: tuple[str, ...]  # names of the world mesh's dims it runs over (empty: point to point, unknown)
    group_size: int
    bytes_sent: int
    bytes_received: int
    link_class: str
    time_us: float


@dataclass(frozen=True)
class Forecast:
    """What one step costs one rank: its collectives, their modeled time, its peak memory by role."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    rank: int
    profile: HardwareProfile
    collectives: tuple[CollectiveForecast, ...]
    peak_bytes: int
    peak_by_category: dict[str, int]
    seconds: float = field(default=0.0, compare=False)  # wall time the forecast took

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def communication_us(self) -> float:
        """The step's communication time, collectives one after another (no overlap)."""
        return sum(collective.time_us for collective in self.collectives)

    def by_mesh_dims(self) -> dict[tuple[str, ...], dict]:
        """Per group of mesh dims: link class, group size, counts and bytes by kind, and time."""
        summary: dict[tuple[str, ...], dict] = {}
        for collective in self.collectives:
            entry = summary.setdefault(collective.mesh_dims, {
                "link_class": collective.link_class, "group_size": collective.group_size,
                "counts": collections.Counter(), "bytes_sent": collections.Counter(),
                "bytes_received": collections.Counter(), "time_us": 0.0,
            })
            entry["counts"][collective.kind] += 1
            entry["bytes_sent"][collective.kind] += collective.bytes_sent
            entry["bytes_received"][collective.kind] += collective.bytes_received
            entry["time_us"] += collective.time_us
        return summary

    def __str__(self) -> str:
        shape = "x".join(map(str, self.mesh_shape))
        names = ", ".join(f"{name}={size}" for name, size in zip(self.mesh_dim_names, self.mesh_shape))
        lines = [
            f"forecast of one step on rank {self.rank} of {self.world_size} (mesh {shape}: {names}), "
            f"profile {self.profile.name} ({self.profile.ranks_per_node} ranks per node)",
            "communication per mesh dim:",
        ]
        for mesh_dims, entry in self.by_mesh_dims().items():
            where = "+".join(mesh_dims) or "(point to point)"
            lines.append(f"  {where:<14} group {entry['group_size']:>5}, {entry['link_class']:<10} "
                         f"{_us(entry['time_us'])}")
            for kind, count in sorted(entry["counts"].items()):
                lines.append(f"    {count:>4} x {kind:<15} sent {_bytes(entry['bytes_sent'][kind]):>10}, "
                             f"received {_bytes(entry['bytes_received'][kind]):>10}")
        if not self.collectives:
            lines.append("  (none)")
        lines.append(f"modeled communication time: {_us(self.communication_us)} (no overlap with compute)")
        lines.append(f"peak memory: {_bytes(self.peak_bytes)} = " + ", ".join(
            f"{category.replace('_', ' ')} {_bytes(self.peak_by_category[category])}" for category in CATEGORIES))
        lines.append(f"(forecast took {self.seconds:.1f} s)")
        return "\n".join(lines)


def _bytes(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def _us(microseconds: float) -> str:
    return f"{microseconds / 1000:.3f} ms" if microseconds >= 1000 else f"{microseconds:.1f} us"


def link_class(mesh_shape: Sequence[int], coordinate: Sequence[int], mesh_dims: Sequence[int], ranks_per_node: int) -> str:
    """Intra-node when every rank of this coordinate's group over `mesh_dims` lies on this rank's node
    (ranks numbered row-major over the mesh, `ranks_per_node` consecutive ranks per node)."""
    strides = [math.prod(mesh_shape[mesh_dim + 1:]) for mesh_dim in range(len(mesh_shape))]
    base = sum(c * s for mesh_dim, (c, s) in enumerate(zip(coordinate, strides)) if mesh_dim not in mesh_dims)
    nodes = set()
    for position in itertools.product(*(range(mesh_shape[mesh_dim]) for mesh_dim in mesh_dims)):
        rank = base + sum(p * strides[mesh_dim] for p, mesh_dim in zip(position, mesh_dims))
        nodes.add(rank // ranks_per_node)
        if len(nodes) > 1:
            return INTER_NODE
    return INTRA_NODE


def price(records: Sequence[CommRecord], mesh_shape: Sequence[int], mesh_dim_names: Sequence[str],
          coordinate: Sequence[int], profile: HardwareProfile,
          flattened: dict[str, tuple[int, ...]] | None = None) -> tuple[CollectiveForecast, ...]:
    """Each record priced by its link class's `CostModel.step_cost` (the planner's), on the bytes it receives."""
    flattened = flattened or {}
    links: dict[tuple[int, ...], str] = {}
    priced = []
    for record in records:
        dims = _world_dims(record, mesh_dim_names, flattened)
        if dims is None:  # no named mesh dims: assume the slower link
            names, link = (), INTER_NODE if math.prod(mesh_shape) > profile.ranks_per_node else INTRA_NODE
        else:
            names = tuple(mesh_dim_names[dim] for dim in dims)
            if dims not in links:
                links[dims] = link_class(mesh_shape, coordinate, dims, profile.ranks_per_node)
            link = links[dims]
        cost = profile.link(link).step_cost(record.kind, max(record.bytes_received, record.bytes_sent))
        priced.append(CollectiveForecast(record.kind, names, record.group_size, record.bytes_sent,
                                         record.bytes_received, link, cost))
    return tuple(priced)


def _world_dims(record: CommRecord, mesh_dim_names: Sequence[str], flattened: dict[str, tuple[int, ...]]):
    if not record.mesh_dim_names:
        return None
    dims = []
    for name in record.mesh_dim_names:
        if name in mesh_dim_names:
            dims.append(mesh_dim_names.index(name))
        elif name in flattened:
            dims.extend(flattened[name])
        else:
            return None
    return tuple(dims)


def forecast(make_step: Callable[..., Callable[[], object]], mesh_shape: Sequence[int], *args,
             mesh_dim_names: Sequence[str] | None = None, rank: int = 0,
             profile: str | HardwareProfile = "dgx-h100", ranks_per_node: int | None = None,
             warmup_steps: int = 1, **kwargs) -> Forecast:
    """Forecast one step of `make_step(mesh, *args, **kwargs)()` on `rank` of a world of prod(mesh_shape).

    `make_step` builds the model, optimizer and inputs for the mesh it is given (a `DeviceMesh` of
    `mesh_shape` named `mesh_dim_names`, default "d0", "d1", ...) and returns the step. It runs on
    fake tensors over a fake process group: factories make shapes without data, collectives move
    nothing, and a scalar read (`.item()`) gives 0. `warmup_steps` steps run first (an optimizer
    makes its state in its first step), then one step is recorded: every collective through
    `shardtensor.comm`, priced by `profile` (a name of `PROFILES`, "gloo-local", or a
    `HardwareProfile`; `ranks_per_node` overrides its own), and the peak of live tensor bytes.
    """
    mesh_shape = tuple(int(size) for size in mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"d{i}" for i in range(len(mesh_shape)))
    if len(names) != len(mesh_shape):
        raise ValueError(f"forecast: {len(names)} mesh_dim_names {names} for a mesh of {len(mesh_shape)} dims {mesh_shape}")
    chosen = profile_named(profile) if isinstance(profile, str) else profile
    if ranks_per_node is not None:
        chosen = chosen.with_ranks_per_node(ranks_per_node)
    began = time.perf_counter()
    with fake_world(mesh_shape, names, rank) as (mesh, counter), counter.learning_roles():
        step = make_step(mesh, *args, **kwargs)
        for _ in range(warmup_steps):
            step()
        counter.reset_peak()
        with comm.observe() as records:
            step()
        peak, by_category = counter.peak, counter.peak_by_category()
        flattened = dict(mesh._flattened)
        coordinate = mesh.get_coordinate()
    collectives = price(records, mesh_shape, names, coordinate, chosen, flattened)
    return Forecast(mesh_shape, names, rank, chosen, collectives, peak, by_category, time.perf_counter() - began)

