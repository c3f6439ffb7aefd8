"""Sharding rules per op family, collected in one registry (`ops.registry.RULES`).

Importing this package imports every family module, and each registers its table of rules.
"""

from . import matrix, nn, pointwise, random_ops, reductions, registry, tensor_ops, views  # noqa: F401
