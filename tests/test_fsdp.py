"""fully_shard: training equals single-device training; one all-gather / reduce-scatter per unit, counted."""

import copy

import torch
from spmd import spmd
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, comm
from shardtensor.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

BATCH = 8


class Block(nn.Module):
    """30 hidden rows: uneven over 4 ranks (8, 8, 8, 6)."""

    def __init__(self, width: int = 12, hidden: int = 30):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    """Input projection, two blocks, a 7-row head (uneven over 4 ranks: 2, 2, 2, 1)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(12, 7)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(dtype=torch.float64) -> Model:
    torch.manual_seed(0)
    return Model().to(dtype)


def _batches(steps: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 5, generator=generator, dtype=dtype), torch.randn(BATCH, 7, generator=generator, dtype=dtype))
            for _ in range(steps)]


def _local_batch(tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    return tensor.chunk(ranks)[rank]


def _loss(output, target):
    return ((output - target) ** 2).mean()


def _shard(model: Model, mesh, nested: bool = True, **options) -> Model:
    if nested:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def _data_parallel_rank(mesh) -> tuple[int, int]:
    return mesh.get_rank(), mesh.size()


def _train_reference(model, batches):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in batches:
        _loss(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _train_sharded(model, batches, rank, ranks):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in batches:
        _loss(model(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _assert_same_parameters(sharded, reference):
    for (name, parameter), (_, expected) in zip(sharded.named_parameters(), reference.named_parameters(), strict=True):
        assert isinstance(parameter, DTensor), name
        assert_close(parameter.full_tensor(), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


@spmd(meshes=[(1,), (2,), (4,)], simulated=[(8,)])
def test_training_equals_single_device_with_uneven_rows(mesh):
    batches = _batches(3)
    reference = _train_reference(_model(), batches)
    sharded = _shard(_model(), mesh)
    rank, ranks = _data_parallel_rank(mesh)
    _train_sharded(sharded, batches, rank, ranks)
    _assert_same_parameters(sharded, reference)


@spmd(meshes=[(4,)])
def test_parameters_are_exact_uneven_shards_without_padding(mesh):
    model = _shard(_model(), mesh)
    rank = mesh.get_rank()
    head = model.head.weight
    assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)
    assert type(model).__mro__[1] is FSDPModule and isinstance(head, nn.Parameter)
    assert head.placements == (Shard(0),) and head.shape == (7, 12)
    assert head.to_local().shape == ([2, 2, 2, 1][rank], 12)
    up = model.blocks[0].up.weight
    assert up.to_local().shape == ([8, 8, 8, 6][rank], 12)
    # the unit's pieces on this rank share one buffer (what its all-gather sends), without a padding byte
    pieces = [parameter.to_local() for parameter in model.blocks[0].parameters()]
    assert {piece.untyped_storage().data_ptr() for piece in pieces} == {up.to_local().untyped_storage().data_ptr()}
    assert up.to_local().untyped_storage().nbytes() == sum(piece.numel() for piece in pieces) * 8
    assert_close(up.full_tensor(), _model().blocks[0].up.weight.detach())


def _kinds(records):
    counts = {}
    for record in records:
        counts[record.kind] = counts.get(record.kind, 0) + 1
    return counts


def _step_records(model, inputs, target):
    """The collectives of forward, backward and optimizer step, each observed on its own."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with comm.observe() as forward:
        loss = _loss(model(inputs), target)
    with comm.observe() as backward:
        loss.backward()
    with comm.observe() as step:
        optimizer.step()
        optimizer.zero_grad()
    return _kinds(forward), _kinds(backward), _kinds(step)


@spmd(meshes=[(2,), (4,)], simulated=[(8,)])
def test_one_all_gather_per_unit_forward_and_one_reduce_scatter_per_unit_backward(mesh):
    rank, ranks = _data_parallel_rank(mesh)
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in _batches(1)[0])
    for reshard_after_forward, backward_gathers in ((None, 2), (True, 3), (False, 0)):
        model = _shard(_model(), mesh, reshard_after_forward=reshard_after_forward)
        for _ in range(2):  # the second step runs with prefetching from the recorded order
            forward, backward, step = _step_records(model, inputs, target)
            assert forward == {"all_gather": 3}, forward
            assert backward == ({"all_gather": backward_gathers, "reduce_scatter": 3} if backward_gathers
                                else {"reduce_scatter": 3}), backward
            assert step == {}, step


@spmd(meshes=[(2,), (4,)])
def test_training_equals_single_device_without_nesting_and_for_every_reshard_choice(mesh):
    batches = _batches(2)
    reference = _train_reference(_model(), batches)
    rank, ranks = _data_parallel_rank(mesh)
    for nested, reshard_after_forward in ((False, None), (True, True), (True, False)):
        sharded = _shard(_model(), mesh, nested=nested, reshard_after_forward=reshard_after_forward)
        _train_sharded(sharded, batches, rank, ranks)
        _assert_same_parameters(sharded, reference)


@spmd(meshes=[(2,), (4,)])
def test_gradient_accumulation_without_sync_communicates_once(mesh):
    micro_batches = _batches(3)
    reference = _model()
    for inputs, target in micro_batches:
        _loss(reference(inputs), target).backward()
    sharded = _shard(_model(), mesh)
    rank, ranks = _data_parallel_rank(mesh)
    for index, (inputs, target) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        sharded.set_requires_gradient_sync(last)
        with comm.observe() as records:
            loss = _loss(sharded(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks))
            loss.backward()
        assert _kinds(records).get("reduce_scatter", 0) == (3 if last else 0)
        if not last:
            assert all(parameter.grad is None for parameter in sharded.parameters())
    for (name, parameter), expected in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        assert parameter.grad.placements == (Shard(0),) and parameter.grad.to_local().shape == parameter.to_local().shape
        assert_close(parameter.grad.full_tensor(), expected.grad, msg=name)


def _mixed_precision_reference(model, batches, ranks):
    """bf16 compute on each data-parallel slice, fp32 sum of the bf16 gradients divided by the ranks, fp32 AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in batches:
        summed = [torch.zeros_like(parameter) for parameter in model.parameters()]
        for rank in range(ranks):
            low = copy.deepcopy(model).to(torch.bfloat16)
            output = low(_local_batch(inputs, rank, ranks).to(torch.bfloat16)).float()
            _loss(output, _local_batch(target, rank, ranks)).backward()
            for total, parameter in zip(summed, low.parameters()):
                total += parameter.grad.float()
        for parameter, total in zip(model.parameters(), summed):
            parameter.grad = total / ranks
        optimizer.step()
        optimizer.zero_grad()
    return model


def _mixed_precision_model(mesh):
    """bf16 blocks and root; the root alone returns fp32 (a block's fp32 output would meet the root's bf16 head)."""
    model = _model(torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))


@spmd(meshes=[(2,), (4,)])
def test_bf16_parameters_with_fp32_reduction_equal_the_same_mixed_precision_by_hand(mesh):
    batches = _batches(3, torch.float32)
    rank, ranks = _data_parallel_rank(mesh)
    reference = _mixed_precision_reference(_model(torch.float32), batches, ranks)
    sharded = _mixed_precision_model(mesh)
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in batches[0])
    with comm.observe() as records:
        output = sharded(inputs)
    assert output.dtype == torch.float32
    assert {record.bytes_sent % 2 for record in records} == {0}
    sent = sum(record.bytes_sent for record in records)
    expected_sent = sum(parameter.to_local().numel() * 2 * (ranks - 1) for parameter in sharded.parameters())
    assert sent == expected_sent  # bf16 on the wire, exact pieces
    _loss(output, target).backward()
    assert all(parameter.grad.dtype == torch.float32 for parameter in sharded.parameters())
    sharded = _mixed_precision_model(mesh)
    _train_sharded(sharded, batches, rank, ranks)
    _assert_same_parameters(sharded, reference)


@spmd(meshes=[(2, 2)])
def test_hsdp_replicates_on_mesh_dim_0_and_shards_on_mesh_dim_1(mesh):
    batches = _batches(3)
    reference = _train_reference(_model(), batches)
    sharded = _shard(_model(), mesh)
    head = sharded.head.weight
    assert head.placements == (Replicate(), Shard(0)) and head.to_local().shape == ([4, 3][mesh.get_coordinate()[1]], 12)
    _train_sharded(sharded, batches, mesh.get_rank(), mesh.size())
    _assert_same_parameters(sharded, reference)
    inputs, target = (_local_batch(tensor, mesh.get_rank(), mesh.size()) for tensor in batches[0])
    forward, backward, _ = _step_records(sharded, inputs, target)
    assert forward == {"all_gather": 3} and backward == {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 3}


@spmd(meshes=[(1,), (2,), (4,), (2, 2)])
def test_all_gather_into_writes_exact_pieces_in_coordinate_order(mesh):
    from test_comm import SIZES, meshes_with_unsorted

    for current in meshes_with_unsorted(mesh):
        for mesh_dim in range(current.ndim):
            n, me = current.size(mesh_dim), current.get_local_rank(mesh_dim)
            for sizes in (SIZES["even"][:n], SIZES["uneven"][:n], SIZES["empty_first"][:n]):
                full = torch.arange(sum(sizes), dtype=torch.float32)
                output = torch.full((sum(sizes),), -1.0)
                with comm.observe() as records:
                    handle = comm.all_gather_into(output, full.split(sizes)[me], current, mesh_dim, sizes=sizes, async_op=True)
                    assert handle.wait() is output
                assert torch.equal(output, full)
                if n > 1:
                    others = sum(sizes) - sizes[me]
                    assert records == [comm.CommRecord("all_gather", mesh_dim, n, sizes[me] * 4 * (n - 1), others * 4)]


class _Columns(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 7)
        self.second = nn.Linear(7, 3)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


@spmd(meshes=[(2,), (4,)])
def test_shard_placement_fn_and_a_list_of_modules_as_one_unit(mesh):
    rank, ranks = _data_parallel_rank(mesh)
    torch.manual_seed(0)
    reference = _Columns().double()
    sharded = copy.deepcopy(reference)
    fully_shard([sharded.first, sharded.second], mesh=mesh,
                shard_placement_fn=lambda parameter: Shard(1) if parameter.ndim == 2 else None)
    fully_shard(sharded, mesh=mesh)
    columns = {2: [3, 3], 4: [2, 2, 2, 0]}[ranks]  # torch.chunk of 6 columns; the last rank's piece is empty
    assert sharded.first.weight.placements == (Shard(1),) and sharded.first.weight.to_local().shape == (7, columns[rank])
    assert sharded.first.bias.placements == (Shard(0),)
    generator = torch.Generator().manual_seed(2)
    inputs, target = torch.randn(8, 6, generator=generator, dtype=torch.float64), torch.randn(8, 3, generator=generator, dtype=torch.float64)
    with comm.observe() as records:
        loss = _loss(sharded(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks))
        loss.backward()
    assert _kinds(records) == {"all_gather": 2, "reduce_scatter": 1}  # the list is one unit (resharded once)
    _loss(reference(inputs), target).backward()
    for parameter, expected in zip(sharded.parameters(), reference.parameters(), strict=True):
        assert_close(parameter.grad.full_tensor(), expected.grad)


@spmd(meshes=[(2,)])
def test_explicit_unshard_and_prefetch_lists(mesh):
    rank, ranks = _data_parallel_rank(mesh)
    model = _shard(_model(), mesh)
    first, second = model.blocks
    first.set_modules_to_forward_prefetch([second])
    second.set_modules_to_backward_prefetch([first])
    handle = model.unshard(async_op=True)
    handle.wait()
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in _batches(1)[0])
    with comm.observe() as records:
        loss = _loss(model(inputs), target)
    assert _kinds(records) == {"all_gather": 2}  # the root was gathered before forward
    loss.backward()
    reference = _model()
    full_inputs, full_target = _batches(1)[0]
    _loss(reference(full_inputs), full_target).backward()
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(parameter.grad.full_tensor(), expected.grad)
    second.unshard()
    second.reshard()
    with comm.observe() as records:
        model.set_reshard_after_backward(False)
        _loss(model(inputs), target).backward()
        _loss(model(inputs), target).backward()
    # kept after backward: the second forward gathers nothing; its blocks still reshard after forward (2 backward gathers)
    assert _kinds(records) == {"all_gather": 3 + 2 + 0 + 2, "reduce_scatter": 6}, _kinds(records)


@spmd(meshes=[(2,)])
def test_gradient_divide_factor_scales_the_sum(mesh):
    rank, ranks = _data_parallel_rank(mesh)
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in _batches(1)[0])
    averaged, summed = _shard(_model(), mesh), _shard(_model(), mesh)
    for module in summed.modules():
        if isinstance(module, FSDPModule):  # a unit's own setting, as in PyTorch
            module.set_gradient_divide_factor(1.0)
    for model in (averaged, summed):
        _loss(model(inputs), target).backward()
    for mean, total in zip(averaged.parameters(), summed.parameters()):
        assert_close(total.grad.full_tensor(), mean.grad.full_tensor() * ranks)


@spmd(meshes=[(2,)])
def test_bad_arguments_raise_clear_errors(mesh):
    import pytest

    with pytest.raises(ValueError, match="already sharded"):
        fully_shard(fully_shard(nn.Linear(2, 2), mesh=mesh), mesh=mesh)
    with pytest.raises(ValueError, match="shard_placement_fn returned Replicate"):
        fully_shard(nn.Linear(2, 2), mesh=mesh, shard_placement_fn=lambda parameter: Replicate())
    with pytest.raises(ValueError, match="cannot be sharded with Shard"):
        fully_shard(nn.Linear(2, 2), mesh=mesh, shard_placement_fn=lambda parameter: Shard(2))
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="different dtypes"):
        fully_shard(mixed, mesh=mesh)
    with pytest.raises(TypeError, match="pass an nn.Module"):
        fully_shard([], mesh=mesh)
    with pytest.raises(ValueError, match="floating torch.dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    ignored = nn.Linear(2, 2)
    fully_shard(ignored, mesh=mesh, ignored_params={ignored.bias})
    assert isinstance(ignored.weight, DTensor) and not isinstance(ignored.bias, DTensor)
