"""Every collective shardtensor issues, in mesh-coordinate order, with exact uneven sizes.

Each function works along one mesh dim: the peers are the ranks that share this rank's coordinate
on the other mesh dims, and pieces are indexed by the peer's coordinate along `mesh_dim` (c10d
orders a group by global rank, which may differ; this package hides that). Sizes are lists in
coordinate order; uneven and empty pieces move exactly, with no padding bytes. `mesh_dim` may
also be a tuple of mesh dims: the peers are then the flattened sub-mesh through this rank,
row-major in the order given: one collective over a group of those ranks when the mesh spans the world
(on first use every rank makes the group of every such plane) or when one exists (`DeviceMesh._flatten`);
on a slice without one (a pipeline stage's mesh, whose siblings may run other ops), one collective per
mesh dim with the same result (its members alone cannot make a group: see `peers`).

Observability: every call with more than one rank adds 1 to `call_counts[kind]` and appends a
`CommRecord` to every list yielded by an active `observe()`, also inside a torch.compile graph, each
time the graph runs (see `records`). Bytes are this rank's, for an ideal algorithm (see `CommRecord`).
A one-rank group makes no c10d call and no record, and every function returns its input as is
(collectives over one rank are identities).

    >>> with observe() as records:  # doctest: +SKIP
    ...     total = all_reduce(local, mesh, 0, reduce_op="sum")
    >>> records[0].bytes_sent  # doctest: +SKIP

The package's modules, one job each: `records` (observe, call counts, the op a graph records with),
`handles` (async results), `peers` (coordinate versus c10d group order, size checks), `wire` (how
tensors travel, what each collective is recorded as, the uneven exchange), `collectives` (the collectives along mesh dims), `objects` (Python objects, a gather over a whole mesh) and
`point_to_point` (global-rank send/recv/batch). Names with a leading underscore are shared inside
the package only.
"""

from __future__ import annotations

from .collectives import all_gather, all_gather_into, all_reduce, all_to_all, broadcast, reduce_scatter, scatter
from .handles import CommHandle
from .objects import all_gather_object, all_gather_over_mesh, broadcast_object, share_object
from .point_to_point import PointToPoint, batch_p2p, recv, send
from .records import CommRecord, call_counts, observe

__all__ = [
    "CommRecord", "CommHandle", "PointToPoint", "observe", "call_counts",
    "all_gather", "all_gather_into", "all_to_all", "all_reduce", "reduce_scatter", "broadcast", "scatter",
    "all_gather_object", "all_gather_over_mesh", "broadcast_object", "share_object", "send", "recv", "batch_p2p",
]
