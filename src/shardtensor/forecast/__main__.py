"""`python -m shardtensor.forecast MODULE:FUNCTION MESH`: print the forecast of the step that
`FUNCTION(mesh)` builds (see `shardtensor.forecast.forecast`), e.g.

    python -m shardtensor.forecast my_training:make_step 8x8x16 --names replicate,dp,tp --profile dgx-a100
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .core import forecast
from .profiles import PROFILES


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(size) for size in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a mesh shape is sizes joined by x, e.g. 8x8x16; got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive, got {text!r}")
    return shape


def _function(text: str):
    module, _, name = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"give the step builder as MODULE:FUNCTION, e.g. my_training:make_step; got {text!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise argparse.ArgumentTypeError(f"cannot load {text!r}: {error}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtensor.forecast", description=__doc__.split("\n\n")[0])
    parser.add_argument("make_step", type=_function, help="MODULE:FUNCTION: builds the step on the mesh it is given")
    parser.add_argument("mesh", type=_mesh_shape, help="mesh shape, e.g. 8x8x16")
    parser.add_argument("--names", default=None, help="mesh dim names, comma-separated (default d0,d1,...)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to forecast (default 0)")
    parser.add_argument("--profile", default="dgx-h100", choices=sorted(PROFILES) + ["gloo-local"])
    parser.add_argument("--ranks-per-node", type=int, default=None, help="override the profile's ranks per node")
    arguments = parser.parse_args(argv)
    names = arguments.names.split(",") if arguments.names else None
    result = forecast(arguments.make_step, arguments.mesh, mesh_dim_names=names, rank=arguments.rank,
                      profile=arguments.profile, ranks_per_node=arguments.ranks_per_node)
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
