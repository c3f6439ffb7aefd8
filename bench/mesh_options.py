"""The command line of the benchmarks that run one body on every rank of a mesh (`--mesh 2 2`,
`--repeats`, `--iterations`), shared so that each script keeps only its body and its table."""

from __future__ import annotations

import argparse
import math

import torch


def run_on_mesh(rank_body, description: str, repeats: int, iterations: int) -> tuple[tuple[int, ...], object]:
    """Parse the options, spawn one local rank per mesh position running `rank_body(mesh_shape,
    repeats, iterations)` on one thread each, and return (mesh shape, rank 0's result)."""
    from shardtensor.launch import spawn

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mesh", type=int, nargs="+", default=[2], help="mesh shape, e.g. 2 or 2 2")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--iterations", type=int, default=iterations)
    options = parser.parse_args()
    torch.set_num_threads(1)
    mesh_shape = tuple(options.mesh)
    return mesh_shape, spawn(rank_body, math.prod(mesh_shape), mesh_shape, options.repeats, options.iterations)[0]
