"""Sharding rules per op family, collected in one registry (`ops.registry.RULES`).

Importing this package imports every family module, and each registers its table of rules.
"""

from . import fft, indexing, linalg, matrix, nn, nn_elementwise, nn_spatial, pointwise, random_ops, reductions, registry, shape_ops, tensor_ops, views  # noqa: F401
