"""distribute_tensor, distribute_module and the factories against single-device expectations."""

import pytest
import torch
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from shardtensor.layout import Layout

PLACEMENTS_1D = [[Shard(0)], [Shard(1)], [Replicate()], [Partial()], [Partial("max")], [Partial("avg")]]
PLACEMENTS_2D = [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Partial(), Shard(0)],
                 [Shard(1), Partial("product")]]


def _placement_lists(mesh):
    return PLACEMENTS_1D if mesh.ndim == 1 else PLACEMENTS_2D


def _rank():
    return torch.distributed.get_rank()


@spmd()
def test_every_rank_ends_with_the_source_ranks_data(mesh):
    source = torch.arange(7 * 6, dtype=torch.float64).reshape(7, 6)
    mine = source + 100 * _rank()  # every rank but rank 0 holds other data
    for placements in _placement_lists(mesh):
        dtensor = distribute_tensor(mine, mesh, placements)
        assert dtensor.placements == tuple(placements)
        assert torch.equal(dtensor.full_tensor(), source), placements


@spmd(meshes=[(2,), (2, 2)])
def test_src_data_rank_picks_the_source_and_none_uses_local_data(mesh):
    source_rank = int(mesh.mesh[(1,) * mesh.ndim])
    mine = torch.arange(8.0).reshape(4, 2) + 100 * _rank()
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    dtensor = distribute_tensor(mine, mesh, placements, src_data_rank=1)
    assert torch.equal(dtensor.full_tensor(), torch.arange(8.0).reshape(4, 2) + 100 * source_rank)
    local_only = distribute_tensor(mine, mesh, placements, src_data_rank=None)
    layout = Layout.create(mesh.shape, placements, mine.shape)
    coordinate = mesh.get_coordinate()
    start, rows = layout.local_offset(coordinate)[0], layout.local_shape(coordinate)[0]
    assert torch.equal(local_only.to_local(), mine[start : start + rows])
    with pytest.raises(ValueError, match="src_data_rank"):
        distribute_tensor(mine, mesh, placements, src_data_rank=5)


@spmd(meshes=[(4,)])
def test_distribute_tensor_sends_each_rank_only_its_shard(mesh):
    tensor = torch.ones(8, 16)
    with shardtensor.comm.observe() as records:
        dtensor = distribute_tensor(tensor, mesh, [Shard(0)])
    assert [record.kind for record in records] == ["scatter"]
    if _rank() != 0:
        assert records[0].bytes_received == dtensor.to_local().numel() * 4


@spmd()
def test_distribute_tensor_keeps_requires_grad_and_makes_a_leaf(mesh):
    tensor = torch.ones(4, 4, requires_grad=True)
    dtensor = distribute_tensor(tensor, mesh, [Shard(0)] * mesh.ndim)
    assert dtensor.requires_grad and dtensor.is_leaf
    with pytest.raises(TypeError, match="DTensor"):
        distribute_tensor(dtensor, mesh, [Shard(0)] * mesh.ndim)


@spmd()
def test_distribute_module_replicates_parameters_and_runs_hooks(mesh):
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(reference.state_dict())
    replicate = [Replicate()] * mesh.ndim
    distribute_module(
        model,
        mesh,
        input_fn=lambda module, inputs, device_mesh: tuple(distribute_tensor(x, device_mesh, replicate) for x in inputs),
        output_fn=lambda module, outputs, device_mesh: outputs.full_tensor(),
    )
    assert isinstance(model.weight, DTensor) and model.weight.placements == tuple(replicate)
    assert isinstance(model.weight, torch.nn.Parameter)
    data = torch.linspace(-2, 2, 8).reshape(2, 4)
    torch.testing.assert_close(model(data), reference(data))
    with pytest.raises(RuntimeError, match="already"):
        distribute_module(model, mesh)


@spmd()
def test_factories_allocate_only_the_local_shard(mesh):
    coordinate = mesh.get_coordinate()
    for placements in _placement_lists(mesh):
        layout = Layout.create(mesh.shape, placements, (5, 3))
        for factory, value in [(shardtensor.zeros, 0.0), (shardtensor.ones, 1.0)]:
            dtensor = factory(5, 3, device_mesh=mesh, placements=placements)
            assert tuple(dtensor.to_local().shape) == layout.local_shape(coordinate)
            assert torch.equal(dtensor.full_tensor(), torch.full((5, 3), value)), (factory, placements)
        filled = shardtensor.full((5, 3), 2.5, device_mesh=mesh, placements=placements, dtype=torch.float64)
        assert filled.dtype == torch.float64
        assert torch.equal(filled.full_tensor(), torch.full((5, 3), 2.5, dtype=torch.float64))
        empty = shardtensor.empty((5, 3), device_mesh=mesh, placements=placements, requires_grad=True)
        assert empty.shape == (5, 3) and empty.requires_grad
        assert tuple(empty.to_local().shape) == layout.local_shape(coordinate)
    with mesh:
        assert shardtensor.ones(2).placements == (Replicate(),) * mesh.ndim


@spmd()
def test_linspace_and_logspace_give_the_values_of_one_device(mesh):
    """Bit for bit: torch rounds a range by each value's place in the whole, which a shard keeps."""
    placement_lists = [[Shard(0)], [Replicate()], [Partial()]] if mesh.ndim == 1 else [
        [Shard(0), Shard(0)], [Replicate(), Shard(0)], [Partial(), Shard(0)]]
    cases = [  # (factory, reference, args, kwargs)
        (shardtensor.linspace, torch.linspace, (-1.0, 3.0, 1001), {}),
        (shardtensor.linspace, torch.linspace, (0.1, 0.7, 7), {"dtype": torch.float64}),
        (shardtensor.linspace, torch.linspace, (0, 10, 5), {"dtype": torch.int64}),
        (shardtensor.linspace, torch.linspace, (0.0, 1 + 2j, 6), {}),
        (shardtensor.linspace, torch.linspace, (torch.tensor(2.0), torch.tensor(-2.0), 3), {}),
        (shardtensor.linspace, torch.linspace, (5.0, 5.0, 1), {}),
        (shardtensor.linspace, torch.linspace, (0.0, 1.0, 0), {}),
        (shardtensor.logspace, torch.logspace, (-2.0, 2.0, 999), {}),
        (shardtensor.logspace, torch.logspace, (0.0, 3.0, 7), {"base": 2.0, "dtype": torch.float64}),
    ]
    for placements in placement_lists:
        for factory, reference, args, kwargs in cases:
            dtensor = factory(*args, **kwargs, device_mesh=mesh, placements=placements)
            expected = reference(*args, **kwargs)
            assert dtensor.placements == tuple(placements) and dtensor.dtype == expected.dtype
            assert torch.equal(dtensor.full_tensor(), expected), (factory, args, kwargs, placements)
    start = distribute_tensor(torch.tensor(-1.5), mesh, [Replicate()] * mesh.ndim)
    with_dtensor = shardtensor.linspace(start, 1.5, 4, requires_grad=True, device_mesh=mesh)
    assert with_dtensor.requires_grad and torch.equal(with_dtensor.full_tensor(), torch.linspace(-1.5, 1.5, 4))
    with pytest.raises(ValueError, match=r"^start must be a number or a 0-dimensional tensor, got .* shape \(2,\)"):
        shardtensor.linspace(torch.zeros(2), 1.0, 4, device_mesh=mesh)
    with pytest.raises(ValueError, match="size must be non-negative ints"):
        shardtensor.logspace(0.0, 1.0, -1, device_mesh=mesh)
