"""Sharding rules per op family, collected in one registry (`ops.registry.RULES`).

Importing this package imports every family module, and each registers its table of rules.
"""

from . import attention, distance, fft, indexing, linalg, matrix, nn, nn_elementwise, nn_spatial, pointwise, random_ops, reductions, registry, shape_ops, sparse, tensor_ops, views  # noqa: F401
from . import spatial_conv  # noqa: F401  (after nn: it registers convolution with nn's rows and its own)
from . import spatial_pool  # noqa: F401  (after nn_spatial: pooling with PlaneRule's rows and its own)
from . import spatial_unfold  # noqa: F401  (after nn_spatial: im2col/col2im with PlaneRule's rows and its own)
from . import spatial_norm  # noqa: F401  (after nn and nn_spatial: batch and group norm with their rows and its own)
from . import spatial_resample  # noqa: F401  (after nn_spatial and shape_ops: it takes the pads and upsampling ops)

registry.register_variants()  # after every family: in-place and out= overloads take their functional op's rule

from . import foreach  # noqa: E402, F401  (last: multi-tensor rules wrap the single-tensor ones; no out= variants)
