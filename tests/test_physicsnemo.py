"""PhysicsNeMo ShardTensor's calls on our DTensor (docs/physicsnemo.md): `from_local(sharding_shapes=...)`,
`offsets`, `scatter_tensor`, the handler registry, and the exchange with PyTorch's DTensor; every value is
compared with the single-device tensor it stands for."""

from __future__ import annotations

import math

import pytest
import torch
from spmd import spmd

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, scatter_tensor
from shardtensor.mesh import DeviceMesh
from shardtensor.placement import NormPartial


def _uneven_field(mesh):
    """A global tensor whose tensor dim m is split unevenly (empty shards too) over mesh dim m, its
    placements, this rank's shard, and the sizes along each mesh dim."""
    sizes = {m: [(3 * c + m + 1) % 4 for c in range(mesh.size(m))] for m in range(mesh.ndim)}
    shape = [sum(sizes[m]) for m in range(mesh.ndim)] + [3]
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    coordinate = mesh.get_coordinate()
    local = full
    for m in range(mesh.ndim):
        local = local.narrow(m, sum(sizes[m][: coordinate[m]]), sizes[m][coordinate[m]])
    return full, [Shard(m) for m in range(mesh.ndim)], local.clone(), sizes


def _peer_shapes(local, mesh_dim: int, sizes: list[int]) -> list[tuple[int, ...]]:
    shapes = []
    for size in sizes:
        shape = list(local.shape)
        shape[mesh_dim] = size
        shapes.append(tuple(shape))
    return shapes


@spmd()
def test_from_local_takes_sharding_shapes_and_offsets_are_exact(mesh):
    full, placements, local, sizes = _uneven_field(mesh)
    shapes = {m: _peer_shapes(local, m, sizes[m]) for m in range(mesh.ndim)}
    from_shapes = DTensor.from_local(local, mesh, placements, sharding_shapes=shapes)
    from_sizes = DTensor.from_local(local, mesh, placements, shard_sizes=sizes)
    inferred = DTensor.from_local(local, mesh, placements, sharding_shapes="infer")
    checked = DTensor.from_local(local, mesh, placements, sharding_shapes=shapes, run_check=True)
    assert from_shapes.sharding == from_sizes.sharding == inferred.sharding == checked.sharding
    assert torch.equal(from_shapes.full_tensor(), full)
    coordinate = mesh.get_coordinate()
    expected = tuple(sum(sizes[m][: coordinate[m]]) for m in range(mesh.ndim)) + (0,)
    assert from_shapes.offsets() == expected
    assert [from_shapes.offsets(m) for m in range(mesh.ndim)] == list(expected[: mesh.ndim])
    region = full
    for dim, (offset, length) in enumerate(zip(from_shapes.offsets(), local.shape)):
        region = region.narrow(dim, offset, length)
    assert torch.equal(region, local)
    chunked = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(1)] + [Replicate()] * (mesh.ndim - 1),
                                 sharding_shapes="chunk")
    assert chunked.shape == (2, 3 * mesh.size(0)) and chunked.offsets(0) == 3 * coordinate[0]
    assert chunked.offsets() == (0, 3 * coordinate[0])
    if mesh.ndim == 2:
        assert chunked.offsets(1) == 0  # a Replicate mesh dim shards nothing
        nested = distribute_tensor(torch.arange(7.0), mesh, [Shard(0), Shard(0)])  # pieces 2, 2, 2, 1
        start = nested.offsets()[0]
        assert torch.equal(torch.arange(7.0)[start:start + nested.to_local().shape[0]], nested.to_local())
        assert start == [0, 2, 4, 6][2 * coordinate[0] + coordinate[1]]


@spmd(meshes=[(2,), (2, 2)])
def test_sharding_shapes_mistakes_name_what_was_expected(mesh):
    _, placements, local, sizes = _uneven_field(mesh)
    shapes = {0: _peer_shapes(local, 0, sizes[0])}
    with pytest.raises(ValueError, match="not both"):
        DTensor.from_local(local, mesh, placements, sharding_shapes=shapes, shard_sizes=sizes)
    with pytest.raises(ValueError, match=r"expected 2 shapes \(one per coordinate along it\)"):
        DTensor.from_local(local, mesh, placements, sharding_shapes={0: shapes[0] + shapes[0]})
    wrong = [tuple(shape[:-1]) + (shape[-1] + 1,) for shape in shapes[0]]
    with pytest.raises(ValueError, match=r"gives coordinate 0 of mesh dim 0 the shape .*; expected"):
        DTensor.from_local(local, mesh, placements, sharding_shapes={0: wrong})
    disagreeing = [shapes[0][0], tuple(shapes[0][1][:-1]) + (7,)]  # off the sharded dim, entries must agree
    with pytest.raises(ValueError, match=r"gives coordinate 1 of mesh dim 0 the shape .*; expected"):
        DTensor.from_local(local, mesh, placements, sharding_shapes={0: disagreeing}, run_check=True)
    with pytest.raises(ValueError, match="not a mesh dim with a Shard placement"):
        DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, sharding_shapes={0: shapes[0]})
    with pytest.raises(ValueError, match="neither 'infer', 'chunk' nor a mapping"):
        DTensor.from_local(local, mesh, placements, sharding_shapes="even")
    if mesh.ndim == 2:
        with pytest.raises(ValueError, match="sharded by several mesh dims"):
            DTensor.from_local(torch.ones(2), mesh, [Shard(0), Shard(0)], sharding_shapes={0: [(2,), (2,)]})


_SCATTER_PLACEMENTS = {
    1: [[Shard(0)], [Shard(1)], [Replicate()]],
    2: [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(0), Shard(0)], [Partial(), Shard(1)]],
}


@spmd()
def test_scatter_tensor_gives_each_rank_its_shard_of_the_source_tensor(mesh):
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)  # uneven on every mesh
    source = mesh.mesh.flatten().tolist()[-1]
    mine = mesh.get_rank() == source
    for placements in _SCATTER_PLACEMENTS[mesh.ndim]:
        with comm.observe() as records:
            scattered = scatter_tensor(full.clone() if mine else None, source, mesh, placements)
        expected = distribute_tensor(full, mesh, placements)
        assert scattered.sharding == expected.sharding and torch.equal(scattered.to_local(), expected.to_local())
        assert torch.equal(scattered.full_tensor(), full) and not scattered.requires_grad
        if mesh.size() > 1:  # the shape and dtype (two broadcasts: length, pickle), then one scatter
            assert [record.kind for record in records] == ["broadcast", "broadcast", "scatter"]
            if not mine:
                assert records[-1].bytes_received == expected.to_local().nbytes
    given = scatter_tensor(full.double() if mine else None, source, mesh, [Shard(0)] * mesh.ndim,
                           global_shape=(7, 5), dtype=torch.float64, requires_grad=True)
    assert given.is_leaf and given.requires_grad and given.dtype == torch.float64
    (given * given).sum().backward()
    assert torch.equal(given.grad.full_tensor(), 2 * full.double())
    if mesh.ndim == 2:  # a mesh of ranks 0 and 1 of the 4: ranks 2 and 3 are outside and take no part
        pair = DeviceMesh("cpu", [0, 1])
        outside = mesh.get_rank() >= 2
        if outside:
            with pytest.raises(ValueError, match="pass global_shape and dtype on ranks outside the mesh"):
                scatter_tensor(None, 1, pair, [Shard(0)])
        half = scatter_tensor(full if mesh.get_rank() == 1 else None, 1, pair, [Shard(0)],
                              global_shape=(7, 5) if outside else None, dtype=torch.float32 if outside else None)
        if outside:
            assert half.shape == (7, 5) and half.to_local().numel() == 0
        else:
            assert torch.equal(half.to_local(), full[:4] if mesh.get_rank() == 0 else full[4:])


@spmd(meshes=[(2,), (2, 2)])
def test_scatter_tensor_refuses_alike_on_every_rank(mesh):
    source = mesh.mesh.flatten().tolist()[-1]
    mine = mesh.get_rank() == source
    with pytest.raises(ValueError, match="the rank global_src must pass the plain torch.Tensor"):
        scatter_tensor(None, source, mesh, [Shard(0)] * mesh.ndim)
    with pytest.raises(ValueError, match=r"dtype=torch.float16 but the tensor on global_src=\d"):
        scatter_tensor(torch.ones(4) if mine else None, source, mesh, [Shard(0)] * mesh.ndim, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"global_shape=\(5,\) but"):
        scatter_tensor(torch.ones(4) if mine else None, source, mesh, [Shard(0)] * mesh.ndim, global_shape=(5,))
    with pytest.raises(ValueError, match="is not a global rank of"):
        scatter_tensor(None, mesh.size() + 3, mesh, [Shard(0)] * mesh.ndim)
    with pytest.raises(ValueError, match="out of range|tensor dim"):
        scatter_tensor(torch.ones(4) if mine else None, source, mesh, [Shard(2)] * mesh.ndim)


def _peak_allocated_bytes(function) -> tuple[int, object]:
    """The highest number of bytes the CPU allocator held at once while `function` ran, above what it held
    before: the profiler's allocation and free events (each op's own allocations, and every free), summed
    in time order. It sees every tensor allocated through torch's CPU allocator, whoever asks for it
    (c10d's receive buffers included), which a TorchDispatchMode or tracemalloc would not."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = function()
    held = peak = 0
    for event in sorted(profiler.events(), key=lambda event: event.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak, result


@spmd(meshes=[(4,), (2, 2)])
def test_scatter_tensor_holds_no_more_than_the_shard_on_other_ranks(mesh):
    full = torch.arange(1 << 18, dtype=torch.float32).reshape(512, 512)  # 1 MiB; 256 KiB shards
    mine = mesh.get_rank() == 0
    placements = [Shard(0)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    peak, scattered = _peak_allocated_bytes(lambda: scatter_tensor(full if mine else None, 0, mesh, placements))
    shard = scattered.to_local().nbytes
    assert shard == full.nbytes // 4
    if not mine:
        assert shard <= peak <= 1.1 * shard, (peak, shard)
        # The measure sees a receive buffer: PhysicsNeMo's way (broadcast the whole tensor) holds all of it.
        broadcast_peak, _ = _peak_allocated_bytes(lambda: comm.broadcast(torch.empty_like(full), mesh, 0))
        assert broadcast_peak >= full.nbytes
    else:
        comm.broadcast(full, mesh, 0)
    assert torch.equal(scattered.full_tensor(), full)


# ---- handlers ----------------------------------------------------------------------------------------


@torch.library.custom_op("physicsnemo_test::laplacian", mutates_args=())
def laplacian(field: torch.Tensor) -> torch.Tensor:
    """A periodic 1-d Laplacian along the last dim of a plain tensor (a stencil custom op)."""
    return field.roll(1, -1) + field.roll(-1, -1) - 2 * field


laplacian.register_autograd(lambda ctx, grad: laplacian(grad))  # symmetric: its own adjoint


def _laplacian_handler(func, types, args, kwargs):
    """The docs example: the custom op on a DTensor sharded along its last dim, by a halo exchange."""
    from shardtensor.experimental import halo_map

    return halo_map(func, dims=(-1,), halo=1, edge="circular")(*args, **kwargs)


@spmd()
def test_a_named_handler_runs_a_custom_stencil_op_with_a_halo_exchange_and_its_gradient(mesh):
    full = torch.arange(2 * 11, dtype=torch.float64).reshape(2, 11).pow(2)  # uneven shards of the last dim
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(1)]
    expected = laplacian(full)
    weights = torch.linspace(-1, 1, 22, dtype=torch.float64).reshape(2, 11)
    single = full.clone().requires_grad_()
    (laplacian(single) * weights).sum().backward()
    DTensor.register_named_function_handler("physicsnemo_test.laplacian.default", _laplacian_handler)
    try:
        field = distribute_tensor(full.clone().requires_grad_(), mesh, placements)
        with comm.observe() as records:
            result = laplacian(field)
        assert isinstance(result, DTensor) and result.placements == field.placements
        assert torch.equal(result.full_tensor(), expected)
        assert {record.kind for record in records} <= {"batch_p2p"}  # neighbours' rows only
        (result * distribute_tensor(weights, mesh, placements)).sum().backward()
        assert torch.allclose(field.grad.full_tensor(), single.grad)
        with DTensor.enable_patches(False):  # the library's path: no rule for a custom op, so the fallback
            assert not DTensor.patches_enabled()
            assert torch.equal(laplacian(field.detach()).full_tensor(), expected)
        assert DTensor.patches_enabled()
    finally:
        DTensor.register_named_function_handler("physicsnemo_test.laplacian.default", None)


@spmd()
def test_function_and_dispatch_handlers_come_before_rules_and_compose_with_autograd(mesh):
    full = torch.linspace(-2, 2, 12, dtype=torch.float64).reshape(4, 3)
    x = distribute_tensor(full, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)).requires_grad_()
    torch.nn.functional.gelu(x)  # a function plan learnt before the handlers: it must not bypass them
    seen = []

    def gelu_handler(func, types, args, kwargs):
        seen.append((func, types, kwargs))
        return func(*args, **kwargs) * 2  # inside its handler, `func` takes the library's path

    def mul_handler(*args, **kwargs):
        seen.append(("mul", len(args)))
        return torch.ops.aten.mul.Tensor(*args, **kwargs)

    DTensor.register_function_handler(torch.nn.functional.gelu, gelu_handler)
    DTensor.register_dispatch_handler(torch.ops.aten.mul.Tensor, mul_handler)
    try:
        for _ in range(2):  # the second call finds no plan that skips the handlers
            seen.clear()
            y = torch.nn.functional.gelu(x, approximate="tanh")
            assert seen[0] == (torch.nn.functional.gelu, (DTensor,), {"approximate": "tanh"})
            single = full.clone().requires_grad_()
            expected = torch.nn.functional.gelu(single, approximate="tanh") * 2
            assert torch.allclose(y.full_tensor(), expected)
            z = x * y  # through the dispatch handler, also in backward (mul's derivative is mul)
            forward_muls = seen.count(("mul", 2))
            assert forward_muls >= 1
            z.sum().backward()
            (single * expected).sum().backward()
            assert seen.count(("mul", 2)) > forward_muls
            assert torch.allclose(x.grad.full_tensor(), single.grad)
            x.grad = None
    finally:
        DTensor.register_function_handler(torch.nn.functional.gelu, None)
        DTensor.register_dispatch_handler(torch.ops.aten.mul.Tensor, None)
    seen.clear()
    torch.nn.functional.gelu(x) * x
    assert not seen
    with pytest.raises(TypeError, match="takes an aten overload"):
        DTensor.register_dispatch_handler(torch.ops.aten.mul, mul_handler)
    with pytest.raises(TypeError, match="must be callable"):
        DTensor.register_function_handler(torch.add, "add")


# ---- PyTorch's DTensor ---------------------------------------------------------------------------------


def _torch_placements(placements):
    import torch.distributed.tensor as torch_tensor

    kinds = {Shard: lambda p: torch_tensor.Shard(p.dim), Replicate: lambda p: torch_tensor.Replicate(),
             Partial: lambda p: torch_tensor.Partial(p.reduce_op)}
    return [kinds[type(placement)](placement) for placement in placements]


@spmd()
def test_to_dtensor_and_back_share_the_shard_and_carry_gradients(mesh):
    from torch.distributed.tensor import DTensor as TorchDTensor

    full = torch.linspace(-1, 1, 7 * 3, dtype=torch.float64).reshape(7, 3)  # torch.chunk's uneven shards
    for placements in ([Shard(0)] * mesh.ndim, [Replicate()] * (mesh.ndim - 1) + [Shard(1)]):
        x = distribute_tensor(full, mesh, placements).requires_grad_()
        theirs = x.to_dtensor()
        assert isinstance(theirs, TorchDTensor) and list(theirs.placements) == _torch_placements(placements)
        assert theirs.to_local().data_ptr() == x.to_local().data_ptr()
        assert list(theirs.device_mesh.mesh.flatten().tolist()) == mesh.mesh.flatten().tolist()
        assert torch.equal(theirs.full_tensor(), full)
        ((theirs * theirs).sum() * 3).backward()  # torch's ops; the gradient comes back to our leaf
        assert torch.allclose(x.grad.full_tensor(), 6 * full)
        assert x.to_dtensor().device_mesh is theirs.device_mesh  # one torch mesh per mesh: no new groups
        back = DTensor.from_dtensor(x.detach().to_dtensor())
        assert back.device_mesh == mesh and back.sharding == x.sharding
        assert back.to_local().data_ptr() == x.to_local().data_ptr()
    partial = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()] * mesh.ndim)
    assert torch.equal(partial.to_dtensor().full_tensor(), torch.full((2, 3), float(mesh.size())))
    largest = DTensor.from_local(torch.full((2, 3), float(mesh.get_rank())), mesh, [Partial("max")] * mesh.ndim)
    assert list(largest.to_dtensor().placements) == _torch_placements(largest.placements)
    assert DTensor.from_dtensor(largest.to_dtensor()).placements == largest.placements
    norm = DTensor.from_local(torch.ones(2, 3), mesh, [NormPartial(2.0)] * mesh.ndim)
    with pytest.raises(ValueError, match="PyTorch's DTensor has no placement like"):
        norm.to_dtensor()


@spmd()
def test_from_dtensor_takes_pytorchs_dtensors_with_their_gradients(mesh):
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    names = ("dp", "tp")[: mesh.ndim] if mesh.ndim == 2 else None
    theirs_mesh = torch_mesh("cpu", mesh.shape, mesh_dim_names=names)
    full = torch.linspace(-1, 1, 7 * 3, dtype=torch.float64).reshape(7, 3)
    placements = [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)
    weight = torch_distribute(full, theirs_mesh, _torch_placements(placements)).requires_grad_()
    ours = DTensor.from_dtensor(weight)
    assert ours.placements == tuple(placements) and ours.to_local().data_ptr() == weight.to_local().data_ptr()
    assert torch.equal(ours.full_tensor(), full)
    assert DTensor.from_dtensor(weight.detach()).device_mesh == ours.device_mesh  # one mesh per torch mesh
    (ours * ours * 3).sum().backward()  # our ops; the gradient reaches torch's leaf
    assert torch.allclose(weight.grad.full_tensor(), 6 * full)
    with pytest.raises(TypeError, match="takes a torch.distributed.tensor.DTensor"):
        DTensor.from_dtensor(full)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_to_dtensor_refuses_shards_that_are_not_torch_chunks(mesh):
    row = mesh.get_coordinate()[0]
    uneven = DTensor.from_local(torch.ones(row % 2 * 2 + 1, 2), mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    with pytest.raises(ValueError, match="PyTorch's DTensor holds torch.chunk shards only"):
        uneven.to_dtensor()
    mended = uneven.redistribute(placements=[Replicate()] * mesh.ndim).redistribute(placements=uneven.placements)
    assert torch.equal(mended.to_dtensor().full_tensor(), uneven.full_tensor())
