"""DTensor conversions (from_local, to_local, full_tensor, redistribute), forward and backward."""

import math

import pytest
import torch
from helpers import layout_box
from spmd import spmd

from shardtensor import DTensor, DeviceMesh, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.layout import Layout


def _placement_lists(mesh):
    if mesh.ndim == 1:
        return [[Shard(0)], [Shard(1)], [Replicate()]]
    return [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Shard(1), Replicate()]]


def _expected_local(full, mesh, placements):
    layout = Layout.create(mesh.shape, placements, full.shape)
    return layout_box(full, layout, mesh.get_coordinate())


def _rank():
    return torch.distributed.get_rank()


@spmd()
def test_from_local_even_shards_give_the_full_tensor(mesh):
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    for placements in _placement_lists(mesh):
        local = _expected_local(full, mesh, placements)
        dtensor = DTensor.from_local(local, mesh, placements)
        assert dtensor.shape == full.shape and dtensor.placements == tuple(placements)
        assert torch.equal(dtensor.full_tensor(), full)
        assert torch.equal(dtensor.to_local(), local)


@spmd()
def test_from_local_uneven_sizes_are_inferred_exactly(mesh):
    rows = mesh.get_coordinate()[0] + 1  # 1, 2, 3, ... rows: not torch.chunk's split
    total = sum(range(1, mesh.shape[0] + 1))
    full = torch.arange(total * 3, dtype=torch.float32).reshape(total, 3)
    start = sum(range(1, rows))
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    dtensor = DTensor.from_local(full[start : start + rows], mesh, placements)
    assert dtensor.shape == (total, 3)
    assert torch.equal(dtensor.full_tensor(), full)
    if mesh.shape[0] > 1:
        assert "shard_sizes" in repr(dtensor)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_from_local_learns_the_local_shapes_in_one_all_gather(mesh):
    """Inferring uneven shards takes one all_gather of fixed-size records over the whole mesh (it spans the
    world), with run_check too; only a tensor of more than 8 dims, or ranks that disagree (all raise),
    exchange the whole entries after it: two all_gathers per mesh dim of more than one rank."""
    rows = mesh.get_coordinate()[0] + 1  # 1, 2, 3, ... rows: not torch.chunk's split
    total, start = sum(range(1, mesh.shape[0] + 1)), sum(range(1, rows))
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    whole_entries = 2 * sum(size > 1 for size in mesh.shape)
    for trailing, run_check in (((3,), False), ((3,), True), ((2,) + (1,) * 6, False), ((2,) + (1,) * 7, False)):
        full = torch.arange(total * 2 * 3.0)[: total * math.prod(trailing)].reshape(total, *trailing)
        with CommDebugMode() as mode:
            dtensor = DTensor.from_local(full[start : start + rows], mesh, placements, run_check=run_check)
        expected = 1 + (whole_entries if full.ndim > 8 else 0)
        assert mode.get_comm_counts().get("all_gather") == expected, (full.ndim, run_check, mode.get_comm_counts())
        assert dtensor.shape == full.shape and torch.equal(dtensor.full_tensor(), full)
    dtype = torch.float64 if _rank() == 1 else torch.float32
    with CommDebugMode() as mode, pytest.raises(ValueError, match="ranks disagree") as raised:
        DTensor.from_local(torch.ones(rows, 3, dtype=dtype), mesh, placements)
    assert mode.get_comm_counts() == {"all_gather": 1 + whole_entries}
    # run_check was not passed: the message names the inference of the global shape, which exchanged them
    expected = ("from_local (inferring the global shape from every rank's local shape: a Shard placement and no "
                "shape=): ranks disagree: mesh coordinate (0")
    assert str(raised.value).startswith(expected), raised.value
    assert "run_check" not in str(raised.value)


@spmd(meshes=[(2, 2)])
def test_from_local_sizes_inferred_on_both_mesh_dims_give_the_full_tensor_and_move_exactly(mesh):
    """PEER_BUGS #143372/#144109: non-chunk pieces (an empty one included) on each mesh dim, inferred from
    the local shapes; full_tensor, redistributes and an op read the one global tensor."""
    rows, columns = [1, 4], [3, 0]
    row, column = mesh.get_coordinate()
    full = torch.arange(5.0 * 3).reshape(5, 3)
    local = full[sum(rows[:row]):sum(rows[:row + 1]), sum(columns[:column]):sum(columns[:column + 1])]
    dtensor = DTensor.from_local(local.clone(), mesh, [Shard(0), Shard(1)])
    assert dtensor.shape == (5, 3) and torch.equal(dtensor.full_tensor(), full)
    for placements in ([Shard(1), Shard(0)], [Replicate(), Shard(0)], [Shard(0), Replicate()]):
        moved = dtensor.redistribute(placements=placements)
        assert torch.equal(moved.to_local(), layout_box(full, moved.sharding, mesh.get_coordinate())), placements
        assert torch.equal(moved.full_tensor(), full), placements
    kept = dtensor.redistribute(placements=[Shard(0), Replicate()])
    assert kept.sharding.pieces[0] == (1, 4)  # the rows stay where they are: only the columns were gathered
    assert torch.equal((dtensor * 2).sum(0).full_tensor(), (full * 2).sum(0))


@spmd(meshes=[(2,), (4,)])
def test_from_local_explicit_shard_sizes_and_chunk(mesh):
    sizes = [0] * (mesh.shape[0] - 1) + [5]
    coordinate = mesh.get_coordinate()[0]
    full = torch.arange(10.0).reshape(5, 2)
    local = full if coordinate == mesh.shape[0] - 1 else full[:0]
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], shard_sizes={0: sizes})
    assert torch.equal(dtensor.full_tensor(), full)
    chunked = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)], shard_sizes="chunk")
    assert chunked.shape == (2 * mesh.shape[0], 2)
    with pytest.raises(ValueError, match="local tensor"):
        DTensor.from_local(torch.ones(3, 2), mesh, [Shard(0)], shard_sizes={0: sizes})


@spmd(meshes=[(2,), (4,)])
def test_from_local_shape_that_does_not_match_names_both_shapes(mesh):
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*\(1, 3\)"):
        DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], shape=(mesh.shape[0], 3))


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_run_check_broadcasts_replicate_data_and_agrees_on_errors(mesh):
    mine = torch.full((3,), float(_rank()))
    dtensor = DTensor.from_local(mine, mesh, [Replicate()] * mesh.ndim, run_check=True)
    assert torch.equal(dtensor.to_local(), torch.zeros(3))
    dtype = torch.float64 if _rank() == 1 else torch.float32
    with pytest.raises(ValueError, match=r"^from_local\(run_check=True\): ranks disagree: mesh coordinate \(0"):
        DTensor.from_local(torch.ones(3, dtype=dtype), mesh, [Replicate()] * mesh.ndim, run_check=True)
    rows = 2 if _rank() == 1 else 1
    placements = [Replicate()] * mesh.ndim
    with pytest.raises(ValueError, match="disagree"):
        DTensor.from_local(torch.ones(rows, 3), mesh, placements, run_check=True)


@spmd()
def test_bad_placements_are_refused(mesh):
    local = torch.ones(2, 2)
    with pytest.raises(ValueError, match="placements"):
        DTensor.from_local(local, mesh, [Replicate()] * (mesh.ndim + 1))
    with pytest.raises(ValueError, match="out of range"):
        distribute_tensor(local, mesh, [Shard(2)] * mesh.ndim)
    with pytest.raises(TypeError, match="not a Placement"):
        distribute_tensor(local, mesh, ["S0"] * mesh.ndim)
    dtensor = distribute_tensor(local, mesh, [Replicate()] * mesh.ndim)
    with pytest.raises(ValueError, match="only Shard"):
        dtensor.redistribute(mesh, [Partial()] * mesh.ndim)


@spmd(meshes=[(2,), (4,)])
def test_ops_on_other_meshes_are_refused_clearly(mesh):
    reversed_mesh = DeviceMesh("cpu", list(reversed(range(mesh.shape[0]))))
    a = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(4), reversed_mesh, [Shard(0)])
    with pytest.raises(ValueError, match="different meshes"):
        a + b


@spmd()
def test_gradients_through_full_tensor_and_redistribute_match_single_device(mesh):
    full = torch.arange(6 * 5, dtype=torch.float64).reshape(6, 5) / 7
    weight = torch.linspace(-1, 1, 30, dtype=torch.float64).reshape(6, 5)
    for source in _placement_lists(mesh):
        for target in _placement_lists(mesh):
            leaf = distribute_tensor(full.clone().requires_grad_(), mesh, source)
            moved = leaf.redistribute(placements=target)
            assert moved.placements == tuple(target)
            (moved.full_tensor() * weight).sum().backward()
            assert leaf.grad.placements == leaf.placements
            assert torch.equal(leaf.grad.full_tensor(), weight)


@spmd()
def test_from_local_and_to_local_gradients(mesh):
    weight = torch.linspace(-1, 1, 12).reshape(4, 3)
    for placements in _placement_lists(mesh):
        local = _expected_local(torch.ones(4, 3), mesh, placements).clone().requires_grad_()
        dtensor = DTensor.from_local(local, mesh, placements)
        (dtensor.full_tensor() * weight).sum().backward()
        assert torch.equal(local.grad, _expected_local(weight, mesh, placements))
    local = torch.ones(4, 3, requires_grad=True)
    partial = DTensor.from_local(local, mesh, [Partial()] * mesh.ndim)
    assert torch.equal(partial.full_tensor().detach(), torch.ones(4, 3) * mesh.size())
    (partial.full_tensor() * weight).sum().backward()
    assert torch.equal(local.grad, weight)  # a Partial's gradient is Replicate
    leaf = distribute_tensor(torch.ones(4, 3, requires_grad=True), mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    (leaf.to_local() * 2).sum().backward()
    assert torch.equal(leaf.grad.full_tensor(), torch.full((4, 3), 2.0))


@spmd()
def test_same_placements_move_nothing_and_async_waits_on_use(mesh):
    full = torch.arange(20.0).reshape(4, 5)
    placements = [Shard(0)] * mesh.ndim
    dtensor = distribute_tensor(full, mesh, placements)
    with comm.observe() as records:
        same = dtensor.redistribute(placements=placements)
    assert list(records) == []
    assert same.to_local().data_ptr() == dtensor.to_local().data_ptr()
    pending = dtensor.redistribute(placements=[Replicate()] * mesh.ndim, async_op=True)
    assert torch.equal(pending.to_local(), full)
    pending = dtensor.redistribute(placements=[Replicate()] * mesh.ndim, async_op=True)
    assert torch.equal((pending + 1).full_tensor(), full + 1)


@spmd(meshes=[(2,), (2, 2)])
def test_redistribute_without_placements_keeps_them_and_another_mesh_needs_them(mesh):
    """`redistribute()` (PyTorch: "placements is needed") keeps the placements, Partial included: the same
    local tensor, no communication; with `forward_dtype` only a cast. Another mesh needs placements."""
    full = torch.arange(20.0).reshape(4, 5)
    placements = [Shard(0)] + [Partial()] * (mesh.ndim - 1)  # on 2 x 2: two operands of half each
    operand = _expected_local(full, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)) / 2 ** (mesh.ndim - 1)
    dtensor = DTensor.from_local(operand, mesh, placements)
    with comm.observe() as records:
        same, cast = dtensor.redistribute(), dtensor.redistribute(forward_dtype=torch.float64)
        same_mesh = dtensor.redistribute(mesh)
    assert list(records) == []
    for result in (same, cast, same_mesh):
        assert result is not dtensor and result.placements == dtensor.placements == tuple(placements)
    assert same.to_local().data_ptr() == dtensor.to_local().data_ptr() == same_mesh.to_local().data_ptr()
    assert cast.dtype == torch.float64 and torch.equal(cast.full_tensor(), full.double())
    assert torch.equal(same.full_tensor(), full)
    reordered = DeviceMesh("cpu", mesh.mesh.flip(0))
    with pytest.raises(ValueError, match="redistribute to another mesh needs placements"):
        dtensor.redistribute(reordered)


@spmd()
def test_repr_shows_layout(mesh):
    dtensor = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)] * mesh.ndim)
    text = repr(dtensor)
    assert text.startswith("DTensor(local_tensor=") and "placements=(Shard(dim=0)" in text
    assert "device_mesh=" in text


@spmd(meshes=[(2,), (2, 2)])
def test_assigning_data_swaps_the_shard_and_layout_as_module_to_dtype_does(mesh):
    """`module.to(dtype)` sets `param.data` (and `grad.data`) to the converted DTensor: the shard, its
    dtype and the layout must follow the wrapper, or the parameter says float64 while holding float32."""
    full = torch.arange(7.0 * 6).reshape(7, 6)
    linear = torch.nn.Linear(6, 7)
    with torch.no_grad():
        linear.weight.copy_(full)
    linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)] * mesh.ndim))
    linear.weight.grad = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    linear.double()
    for tensor in (linear.weight, linear.weight.grad):
        assert tensor.dtype == tensor.to_local().dtype == torch.float64
        assert torch.equal(tensor.full_tensor(), full.double())
    parameter = linear.weight
    parameter.data = distribute_tensor(full.t().contiguous(), mesh, [Replicate()] * mesh.ndim)
    assert linear.weight is parameter and parameter.placements == (Replicate(),) * mesh.ndim
    assert parameter.shape == (6, 7) and torch.equal(parameter.to_local(), full.t())


# ---- plain tensors that torch itself mixes in: one_hot's arange, backward formulas' ones/zeros -----


@spmd(meshes=[(2,), (2, 2)])
def test_one_hot_of_sharded_labels(mesh):
    import shardtensor

    labels = torch.tensor([3, 0, 2, 2, 1])
    x = distribute_tensor(labels, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    with shardtensor.strict_mode(), comm.observe() as records:
        encoded = torch.nn.functional.one_hot(x, 4)
    assert records == [] and encoded.placements[0] == Shard(0)
    assert torch.equal(encoded.full_tensor(), torch.nn.functional.one_hot(labels, 4))
    with pytest.raises(RuntimeError, match="plain torch.Tensor"):  # outside comparisons: still refused
        x + torch.ones(5, dtype=torch.int64)


@pytest.mark.parametrize("reduction", ["prod_dim", "prod", "cumprod"])
@spmd(meshes=[(2,), (2, 2)])
def test_backward_formulas_with_plain_tensors(mesh, reduction):
    """prod's backward cats a plain torch.ones, cumprod's uses plain zeros in where: read as Replicate."""
    functions = {
        "prod_dim": lambda tensor: tensor.prod(0),
        "prod": lambda tensor: tensor.prod(),
        "cumprod": lambda tensor: tensor.cumprod(1),
    }
    full = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.0, 2.0], [3.0, 1.0, 2.0], [-2.0, 1.0, 0.5]], dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim).requires_grad_()
    functions[reduction](x).sum().backward()
    reference = full.clone().requires_grad_()
    functions[reduction](reference).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), reference.grad, rtol=0, atol=1e-12)
