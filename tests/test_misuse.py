"""API misuse raises a clear exception on every rank, before any collective, and never hangs.

Sparse (COO, CSR), nested and quantized inputs are refused up front by distribute_tensor and
from_local, and ops that would make or take a sparse tensor next to DTensors raise naming the op; meta tensors shard without communication; ranks that pass different dtypes or shapes to
from_local(run_check=True) all raise. A hypothesis test draws wrong placements, shapes and dtypes
(derandomized, so a failure replays) and checks each rank raises the same kind of error.
"""

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.spec import DTensorSpec
from helpers import partial_and_value, torch_mesh
from spmd import spmd


def _dense_inputs_only(tensor, mesh):
    for call in (lambda: distribute_tensor(tensor, mesh, [Replicate()] * mesh.ndim),
                 lambda: DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim)):
        with pytest.raises(TypeError, match="takes a dense strided tensor"):
            call()


@spmd(meshes=[(2,), (2, 2)])
def test_sparse_nested_and_quantized_inputs_are_refused_on_every_rank(mesh):
    dense = torch.arange(12.0).reshape(3, 4)
    _dense_inputs_only(dense.to_sparse(), mesh)
    _dense_inputs_only(dense.to_sparse_csr(), mesh)
    _dense_inputs_only(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), mesh)
    _dense_inputs_only(torch.quantize_per_tensor(dense, 0.5, 0, torch.quint8), mesh)
    # the same data, dense, still works afterwards (no rank was left inside a collective)
    x = distribute_tensor(dense, mesh, [Shard(0)] * mesh.ndim)
    assert torch.equal(x.full_tensor(), dense)


@spmd(meshes=[(2,), (2, 2)])
def test_sparse_ops_on_dtensors_raise_naming_the_op_on_every_rank_without_communication(mesh):
    dense = torch.arange(12.0).reshape(3, 4)
    x = distribute_tensor(dense, mesh, [Shard(0)] * mesh.ndim)
    values = distribute_tensor(dense[0, :2], mesh, [Shard(0)] * mesh.ndim)
    calls = {
        "aten._to_sparse.default": lambda: x.to_sparse(),
        "aten._to_sparse.sparse_dim": lambda: x.to_sparse(1),
        "aten._to_sparse_csr.default": lambda: x.to_sparse_csr(),
        "aten._to_sparse_bsc.default": lambda: x.to_sparse_bsc((1, 2)),
        "aten._sparse_coo_tensor_with_dims_and_tensors.default":
            lambda: torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (4,)),
        "aten.sparse_mask.default": lambda: x.sparse_mask(dense.to_sparse()),
        "aten.mm.default": lambda: torch.mm(x, torch.eye(4).to_sparse()),
        "aten.mul.Tensor": lambda: x * torch.ones(1, 1).to_sparse(),  # one element: still refused
    }
    with comm.observe() as records:
        for op, call in calls.items():
            with pytest.raises(NotImplementedError, match=rf"^{re.escape(op)}: .*sparse layouts \(COO, CSR, CSC, BSR, BSC\) "
                                                          r"are not supported\. Use dense ops on the DTensor"):
                call()
    assert records == []
    assert torch.equal((x * 2).full_tensor(), dense * 2)


@spmd(meshes=[(2,), (2, 2)])
def test_torch_distributed_calls_on_a_dtensor_raise_on_every_rank_without_communication(mesh):
    """torch.distributed's own calls (a pipeline stage's hand-off is an isend) move plain tensors. Given a DTensor,
    each raises naming the op and how to send a shard, instead of gathering it over its mesh first (which hung a
    point-to-point peer inside the mesh, and sent a peer outside it the gathered full tensor)."""
    import torch.distributed as dist

    dense = torch.arange(12.0).reshape(3, 4)
    x = distribute_tensor(dense, mesh, [Shard(0)] * mesh.ndim)
    peer = (mesh.get_rank() + 1) % mesh.size()  # every rank sends, none receives: a hang unless each raises first
    calls = [
        ("c10d.send.default", lambda: dist.send(x, peer)),
        ("c10d.send.default", lambda: dist.isend(x, peer)),
        ("c10d.send.default", lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer)])),
        ("c10d.allreduce_.default", lambda: dist.all_reduce(x)),
        ("c10d.broadcast_.default", lambda: dist.broadcast(x, 0)),
    ]
    with comm.observe() as records:
        for op, call in calls:
            with pytest.raises(TypeError, match=rf"^{re.escape(op)} got a DTensor: .*dtensor\.to_local\(\)"):
                call()
    assert records == []
    assert torch.equal((x * 2).full_tensor(), dense * 2)


@spmd(meshes=[(2,), (2, 2)])
def test_a_meta_tensor_shards_without_communication(mesh):
    x = distribute_tensor(torch.empty(8, 4, device="meta"), mesh, [Shard(0)] * mesh.ndim)
    assert x.to_local().is_meta and tuple(x.shape) == (8, 4)
    assert tuple(x.to_local().shape) == (8 // mesh.size(), 4)


@spmd(meshes=[(2,), (4,)])
def test_from_local_with_rank_dependent_dtype_or_rank_raises_on_every_rank(mesh):
    rank = mesh.get_local_rank()
    dtype = torch.float64 if rank == 0 else torch.float32
    with pytest.raises(ValueError, match="ranks disagree"):
        DTensor.from_local(torch.ones(2, 3, dtype=dtype), mesh, [Shard(0)], run_check=True)
    with pytest.raises(ValueError, match="ranks disagree"):
        DTensor.from_local(torch.ones((2,) * (2 + (rank == 0))), mesh, [Shard(0)], run_check=True)


@spmd(meshes=[(2,), (2, 2)])
def test_partial_avg_of_integers_or_bools_is_refused_on_every_rank_without_communication(mesh):
    """The mean of integer operands is no integer: P(avg) needs a floating or complex dtype, and every
    way of making such a layout says so before any collective (PyTorch fails inside its all_reduce)."""
    rank = mesh.get_rank()
    avg_last = [Shard(0)] * (mesh.ndim - 1) + [Partial("avg")]
    floating, floating_value = partial_and_value(mesh, (4, 2), "avg")
    integers, bools = torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.bool)
    integer_spec = DTensorSpec(mesh, floating.sharding, (2, 1), torch.int64)
    calls = [
        ("DTensor.from_local", lambda: DTensor.from_local(torch.arange(4) + rank, mesh, avg_last)),
        ("DTensor.from_local", lambda: DTensor.from_local(integers, mesh, avg_last, run_check=True)),
        ("DTensor.from_local", lambda: DTensor.from_local(bools, mesh, avg_last, shape=(2 * mesh.size(0),))),
        ("distribute_tensor", lambda: distribute_tensor(torch.arange(4, dtype=torch.int16), mesh, avg_last)),
        (r"DTensor.redistribute\(forward_dtype=...\)", lambda: floating.redistribute(forward_dtype=torch.int64)),
        ("all_reduce", lambda: comm.all_reduce(torch.arange(3), mesh, 0, reduce_op="avg")),
        ("DTensor", lambda: DTensor(torch.zeros(4, 2, dtype=torch.int64), integer_spec)),
    ]
    with comm.observe() as records:
        for function, call in calls:
            message = rf"^{function}: .*'avg'.* needs a floating or complex .*got torch\.(int|bool)"
            with pytest.raises(ValueError, match=message):
                call()
    assert records == []
    # PyTorch's DTensor accepts the layout and fails at its first reduction, inside the all_reduce
    from torch.distributed.tensor import DTensor as TorchDTensor, Partial as TorchPartial

    theirs = TorchDTensor.from_local(torch.arange(4) + rank, torch_mesh(mesh), [TorchPartial("avg")] * mesh.ndim)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type Long"):
        theirs.full_tensor()
    # floating and complex P(avg) are the mean; integers reduce as P(sum); a cast of a P(avg) casts the mean
    complex_avg, complex_value = partial_and_value(mesh, (3,), "avg", dtype=torch.complex64)
    torch.testing.assert_close(complex_avg.full_tensor(), complex_value)
    torch.testing.assert_close(floating.full_tensor(), floating_value)
    assert torch.equal(floating.long().full_tensor(), floating_value.long())
    summed = DTensor.from_local(torch.arange(4) + rank, mesh, [Partial("sum")] * mesh.ndim)
    assert torch.equal(summed.full_tensor(), mesh.size() * torch.arange(4) + sum(range(mesh.size())))


_PLACEMENTS = st.sampled_from([Shard(0), Shard(1), Shard(2), Shard(-4), Replicate(), Partial()])


@settings(max_examples=10, derandomize=True, deadline=None, database=None)
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=2), placements=st.lists(_PLACEMENTS, min_size=0, max_size=3))
def _check_misuse(mesh, shape, placements):
    """distribute_tensor with any placements either works (values exact) or raises a clear error."""
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    context = f"shape {tuple(shape)}, placements {placements}, mesh {mesh.shape}"
    try:
        x = distribute_tensor(full, mesh, placements)
    except (ValueError, IndexError, TypeError) as error:
        message = str(error)
        assert len(message) > 40 and any(word in message for word in ("dim", "mesh", "placement")), (context, message)
        return
    assert torch.equal(x.full_tensor(), full), context


@spmd(meshes=[(2,), (2, 2)])
def test_random_misuse_of_distribute_tensor_raises_clearly_on_every_rank(mesh):
    _check_misuse(mesh)
