"""`ColwiseParallel(output_layouts=Shard(0))` against one device and against torch DTensor: values, the
collectives of forward and backward, and the bytes they move.

The output leaves the layer sharded on its last dim and is moved to Shard(0). Ours exchanges the pieces
(one all_to_all each way); torch gathers the whole output on every rank and keeps its rows (one
all_gather each way, padded to the largest shard). Same number of collectives, and ours moves fewer
bytes (each rank sends the others only their pieces: at most 1/(n-1) of what its all_gather sends, 1/n
with even shards), so ours stays.
"""

import pytest
import torch
from helpers import collective_kinds, torch_mesh
from spmd import spmd
from torch import nn
from torch.testing import assert_close

import shardtensor
import shardtensor.parallel
from shardtensor.debug import CommDebugMode
from shardtensor.layout import chunk_sizes

ITEMSIZE = 8  # float64
IN_FEATURES, OUT_FEATURES, SEQUENCE = 8, 12, 5


def _run(parallel, tensor, debug_mode, mesh, x_full: torch.Tensor):
    """The parallelized Linear's local output, the input's gradient, its parameters' local gradients and
    the forward and backward CommDebugModes, with `parallel`/`tensor` torch's or ours."""
    torch.manual_seed(1)
    linear = nn.Linear(IN_FEATURES, OUT_FEATURES).double()
    parallel.parallelize_module(linear, mesh, parallel.ColwiseParallel(output_layouts=tensor.Shard(0)))
    x = x_full.clone().requires_grad_()
    with debug_mode() as forward:
        out = linear(x)
    with debug_mode() as backward:
        out.pow(2).sum().backward()
    return out, x.grad, [p.grad.to_local() for p in linear.parameters()], forward, backward


@pytest.mark.parametrize("batch", [8, 3], ids=["even", "uneven"])
@spmd(meshes=[(2,), (4,)])
def test_colwise_shard0_output_exchanges_pieces_where_torch_gathers(mesh, batch):
    """Each rank's rows of the single-device output, the single-device input and parameter gradients (both
    libraries); ours: one all_to_all forward and one backward, torch: one all_gather each; both: the
    input's Partial gradient reduced in backward. Bytes by our records' convention, torch's computed
    from the shards it gathers."""
    import torch.distributed.tensor as theirs
    import torch.distributed.tensor.parallel as their_parallel
    from torch.distributed.tensor.debug import CommDebugMode as TheirCommDebugMode

    size, rank = mesh.size(), mesh.get_rank()
    x_full = torch.randn(batch, SEQUENCE, IN_FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    reference_linear = nn.Linear(IN_FEATURES, OUT_FEATURES).double()
    reference_x = x_full.clone().requires_grad_()
    reference = reference_linear(reference_x)
    reference.pow(2).sum().backward()
    rows = chunk_sizes(batch, size)
    columns = OUT_FEATURES // size
    mine = reference.detach().split(rows)[rank]
    parameter_grads = [p.grad.chunk(size)[rank] for p in reference_linear.parameters()]

    their_result = _run(their_parallel, theirs, TheirCommDebugMode, torch_mesh(mesh), x_full)
    our_result = _run(shardtensor.parallel, shardtensor, CommDebugMode, mesh, x_full)
    for out, x_grad, grads, _, _ in (their_result, our_result):
        assert_close(out, mine)
        assert_close(x_grad, reference_x.grad)
        for grad, expected in zip(grads, parameter_grads):
            assert_close(grad, expected)
    *_, their_forward, their_backward = their_result
    *_, our_forward, our_backward = our_result
    assert collective_kinds(their_forward) == {"all_gather": 1}
    assert collective_kinds(their_backward) == {"all_gather": 1, "all_reduce": 1}
    assert collective_kinds(our_forward) == {"all_to_all": 1}
    assert collective_kinds(our_backward) == {"all_to_all": 1, "all_reduce": 1}

    row_bytes = SEQUENCE * ITEMSIZE  # one row of one feature
    # Forward: this rank's columns of the other ranks' rows go out, its rows of the other columns come in.
    exchange = ((batch - rows[rank]) * columns * row_bytes, rows[rank] * (OUT_FEATURES - columns) * row_bytes)
    [forward_record] = our_forward.records
    [backward_exchange, _] = sorted(our_backward.records, key=lambda record: record.kind != "all_to_all")
    assert (forward_record.bytes_sent, forward_record.bytes_received) == exchange
    assert (backward_exchange.bytes_sent, backward_exchange.bytes_received) == exchange[::-1]
    # Torch's all_gathers send (n - 1) copies of the largest shard: the Shard(-1) output, then the
    # Shard(0) gradient.
    their_forward_sent = (size - 1) * batch * columns * row_bytes
    their_backward_sent = (size - 1) * max(rows) * OUT_FEATURES * row_bytes
    assert forward_record.bytes_sent * (size - 1) <= their_forward_sent
    assert backward_exchange.bytes_sent < their_backward_sent
