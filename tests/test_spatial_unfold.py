"""unfold/fold (im2col/col2im) of images sharded on their height (ops/spatial_unfold.py): forward
and backward against the single-device computation, the field moved by halo exchanges only."""

import torch
import torch.nn.functional as F
from spmd import spmd
from test_spatial_pool import _like, _sharded, _uneven
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm

# (name, function, input shape, stride 1: the backward's image shards are the input's)
CASES = [
    ("unfold k3 p1", lambda x: F.unfold(x, 3, padding=1), (2, 3, 9, 5), True),
    ("unfold k(2,3) d(2,1) p(1,0)", lambda x: F.unfold(x, (2, 3), dilation=(2, 1), padding=(1, 0)), (1, 2, 9, 5), True),
    ("unfold k2 s2 (patches)", lambda x: F.unfold(x, 2, stride=2), (1, 2, 10, 6), False),
    ("unfold k3 s2 p1", lambda x: F.unfold(x, 3, stride=2, padding=1), (1, 2, 9, 5), False),
    ("fold of unfold k3 p1", lambda x: F.fold(F.unfold(x, 3, padding=1), (9, 5), 3, padding=1), (2, 3, 9, 5), True),
    ("unbatched unfold k3", lambda x: F.unfold(x, 3), (3, 9, 5), True),
]


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_unfold_and_fold_on_height_shards(mesh):
    torch.manual_seed(0)
    for name, function, shape, same_shards in CASES:
        height = len(shape) - 2
        full = torch.randn(shape, dtype=torch.float64)
        if mesh.ndim == 1:
            layouts = [([Shard(height)], None), ([Shard(height)], _uneven(mesh, shape[height]))]
        else:  # the batch on the second mesh dim (an unbatched image: whole there)
            second = Shard(0) if len(shape) == 4 else Replicate()
            layouts = [([Shard(height), second], {0: [2, shape[height] - 2]})]
        for placements, sizes in layouts:
            x = _sharded(full, mesh, placements, sizes)
            reference = full.clone().requires_grad_()
            try:
                with shardtensor.strict_mode(), comm.observe() as records:
                    y = function(x)
                expected = function(reference)
                assert y.placements[0] == Shard(height)
                assert_close(y.full_tensor(), expected)
                grad = torch.randn_like(expected)
                grad_dtensor = _like(y, grad)
                with shardtensor.strict_mode(), comm.observe() as backward_records:
                    y.backward(grad_dtensor)
                expected.backward(grad)
                assert_close(x.grad.full_tensor(), reference.grad)
                assert {record.kind for record in records} <= {"batch_p2p"}, [record.kind for record in records]
                if same_shards:
                    kinds = {record.kind for record in backward_records}
                    assert kinds <= {"batch_p2p"}, kinds
            except BaseException as error:
                error.add_note(f"{name}, placements {placements}, sizes {sizes}")
                raise
