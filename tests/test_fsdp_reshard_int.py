"""fully_shard(reshard_after_forward=k), k an int: forward gathers over the shard mesh dim, each rank then
keeps the block its sub-group of k ranks needs, backward all-gathers within the sub-group and reduce-scatters
over the whole shard mesh dim. Training equals one device; collectives are counted exactly; PyTorch's
`fully_shard` is the oracle for the counts, the sub-groups and the slice each rank keeps.

Where ours differs from PyTorch's (torch 2.13): between forward and backward the modules show the
usual sharded parameters (PyTorch registers post-forward DTensors on a (n/k, k) mesh); the kept block
is exact `torch.chunk` pieces (PyTorch's is a slice of the padded parameter); `set_reshard_after_forward`
takes an int as `fully_shard` does (PyTorch's takes a bool only); tensor-parallel parameters work
(PyTorch's raise NotImplementedError); a kept block serves only the backward of the step that kept it:
the root's next forward and an explicit `unshard()` gather over the whole shard mesh dim, so a forward
without backward followed by an optimizer step never gathers old values (PyTorch's next forward gathers
the old post-forward shard: checked by hand, with an optimizer's references to the sharded parameters).
"""

import warnings

import pytest
import torch
from spmd import spmd
from test_fsdp import _batches, _kinds, _local_batch, _loss, _model, _shard
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, comm
from shardtensor.debug import CommDebugMode
from shardtensor.fsdp import FSDPModule, fully_shard
from shardtensor.mesh import DeviceMesh

EIGHT_RANKS_TIMEOUT = 300.0  # eight processes on a two-core machine: a no-hang bound, not a time budget


def _units(model) -> list:
    return [module._fsdp_unit for module in model.modules() if isinstance(module, FSDPModule)]


def _records_by_kind(records) -> dict[str, list[int]]:
    """Group sizes of the collectives, by kind (e.g. {"all_gather": [4, 4, 4]})."""
    sizes: dict[str, list[int]] = {}
    for record in records:
        sizes.setdefault(record.kind, []).append(record.group_size)
    return sizes


def _step_in_lockstep(sharded, reference, batches, optimizer_class, data_parallel_rank, data_parallel_size):
    """Train both models on the batches (the sharded one on its slice), checking gradients each step."""
    sharded_optimizer = optimizer_class(sharded.parameters(), lr=0.01)
    reference_optimizer = optimizer_class(reference.parameters(), lr=0.01)
    for inputs, target in batches:
        _loss(reference(inputs), target).backward()
        local_inputs, local_target = (_local_batch(tensor, data_parallel_rank, data_parallel_size) for tensor in (inputs, target))
        _loss(sharded(local_inputs), local_target).backward()
        for (name, parameter), expected in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            assert_close(parameter.grad.full_tensor(), expected.grad, msg=lambda message, name=name: f"{name}: {message}")
        for optimizer in (sharded_optimizer, reference_optimizer):
            optimizer.step()
            optimizer.zero_grad()
    for (name, parameter), expected in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(parameter, DTensor), name
        assert_close(parameter.full_tensor(), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


@spmd(meshes=[(4,)])
def test_training_with_reshard_to_two_ranks_equals_one_device(mesh):
    for optimizer_class in (torch.optim.SGD, torch.optim.AdamW):
        sharded = _shard(_model(), mesh, reshard_after_forward=2)
        _step_in_lockstep(sharded, _model(), _batches(3), optimizer_class, mesh.get_rank(), mesh.size())


def _expected_block(full_parameters, member: int, ranks: int, group_size: int) -> torch.Tensor:
    """What sub-group member `member` keeps: the torch.chunk pieces of its coordinates, coordinate-major."""
    per_member = ranks // group_size
    pieces = []
    for coordinate in range(member * per_member, (member + 1) * per_member):
        for full in full_parameters:
            chunks = full.chunk(ranks)
            if coordinate < len(chunks):
                pieces.append(chunks[coordinate].reshape(-1))
    return torch.cat(pieces)


@spmd(meshes=[(4,)])
def test_backward_gathers_over_two_ranks_and_the_kept_block_is_exact(mesh):
    rank, ranks = mesh.get_rank(), mesh.size()
    model = _shard(_model(), mesh, reshard_after_forward=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in _batches(2):  # the second step prefetches in the recorded order
        with CommDebugMode() as forward:
            loss = _loss(model(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks))
        assert _records_by_kind(forward.records) == {"all_gather": [4, 4, 4]}
        for unit in _units(model):  # between forward and backward: unsharded parameters freed, the block kept
            kept = unit.post_forward._kept
            assert unit._unsharded.untyped_storage().nbytes() == 0 and kept.untyped_storage().nbytes() == kept.numel() * 8
        block = model.blocks[0]._fsdp_unit
        full_parameters = [parameter.full_tensor() for parameter in model.blocks[0].parameters()]
        assert torch.equal(block.post_forward._kept, _expected_block(full_parameters, rank % 2, ranks, 2))
        assert block.post_forward.mesh.mesh.tolist() == [[0, 1], [2, 3]][rank // 2]
        assert all(isinstance(parameter, DTensor) and parameter.placements == model.head.weight.placements
                   for parameter in model.parameters())  # the modules show the usual sharded parameters
        with CommDebugMode() as backward:
            loss.backward()
        assert _records_by_kind(backward.records) == {"all_gather": [2, 2, 2], "reduce_scatter": [4, 4, 4]}
        gathered_bytes = sum(record.bytes_received + record.bytes_sent // (record.group_size - 1)
                             for record in backward.records if record.kind == "all_gather")
        assert gathered_bytes == sum(parameter.numel() for parameter in _model().parameters()) * 8
        assert all(unit.post_forward._kept.untyped_storage().nbytes() == 0 for unit in _units(model))
        optimizer.step()
        optimizer.zero_grad()


@spmd(meshes=[(4,)])
def test_counts_sub_groups_and_kept_slices_match_pytorch_fully_shard(mesh):
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    rank, ranks = mesh.get_rank(), mesh.size()
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in _batches(1)[0])
    torch_model, torch_mesh = _model(), torch_init_device_mesh("cpu", (ranks,))
    for module in (*torch_model.blocks, torch_model):
        torch_fully_shard(module, mesh=torch_mesh, reshard_after_forward=2)
    ours = _shard(_model(), mesh, reshard_after_forward=2)
    torch_names = {"c10d._allgather_base_": "all_gather", "c10d._reduce_scatter_base_": "reduce_scatter"}
    with TorchCommDebugMode() as torch_forward:
        torch_loss = _loss(torch_model(inputs), target)
    with CommDebugMode() as forward:
        loss = _loss(ours(inputs), target)
    # PyTorch's kept slice of an evenly divisible parameter (12 rows of `down`) is the block ours keeps
    torch_down = torch_model.blocks[0].down.weight
    assert torch_down.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    ours_down = ours.blocks[0].down.weight
    rows = slice(6 * (rank % 2), 6 * (rank % 2) + 6)
    assert torch.equal(torch_down.to_local(), _model().blocks[0].down.weight.detach()[rows])
    assert ours.blocks[0]._fsdp_unit.post_forward.mesh.mesh.tolist() == torch_down.device_mesh.mesh.tolist()[rank // 2]
    assert isinstance(ours_down, DTensor) and ours_down.to_local().shape == (3, 30)
    with TorchCommDebugMode() as torch_backward:
        torch_loss.backward()
    with CommDebugMode() as backward:
        loss.backward()
    for torch_mode, our_mode in ((torch_forward, forward), (torch_backward, backward)):
        torch_counts = {torch_names[str(kind)]: count for kind, count in torch_mode.get_comm_counts().items()}
        assert torch_counts == _kinds(our_mode.records), (torch_counts, _kinds(our_mode.records))
    for torch_parameter, parameter in zip(torch_model.parameters(), ours.parameters(), strict=True):
        assert_close(parameter.grad.full_tensor(), torch_parameter.grad.full_tensor())


@spmd(meshes=[(4,)])
def test_bad_values_raise_on_every_rank_naming_what_is_allowed(mesh):
    for bad, error in ((0, ValueError), (3, ValueError), (-2, ValueError), (8, ValueError), (2.0, TypeError), ("2", TypeError)):
        with pytest.raises(error, match=r"pass True, False, None .* or an int in \[2, 4\]"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=bad)
    model = fully_shard(nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(ValueError, match=r"set_reshard_after_forward: reshard_after_forward=3 .* an int in \[2, 4\]"):
        model.set_reshard_after_forward(3)
    unsharded = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="reshard_after_forward=0"):
        fully_shard(unsharded, mesh=mesh, reshard_after_forward=0)
    assert not isinstance(unsharded, FSDPModule) and not isinstance(unsharded.weight, DTensor)  # checked before sharding


def _backward_gather_sizes(model, mesh) -> list[int]:
    rank, ranks = mesh.get_rank(), mesh.size()
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in _batches(1)[0])
    loss = _loss(model(inputs), target)
    with comm.observe() as records:
        loss.backward()
    return _records_by_kind(records).get("all_gather", [])


@spmd(meshes=[(4,)])
def test_one_means_false_and_the_mesh_size_means_true_and_the_setter_takes_ints(mesh):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept_whole = _shard(_model(), mesh, reshard_after_forward=1)
    assert any("reshard_after_forward=1" in str(warning.message) for warning in caught)
    assert _backward_gather_sizes(kept_whole, mesh) == []
    assert _backward_gather_sizes(_shard(_model(), mesh, reshard_after_forward=4), mesh) == [4, 4, 4]
    model = _shard(_model(), mesh)
    model.set_reshard_after_forward(2)
    assert _backward_gather_sizes(model, mesh) == [2, 2, 2]
    model.set_reshard_after_forward(True)
    assert _backward_gather_sizes(model, mesh) == [4, 4, 4]
    model.set_reshard_after_forward(False)
    assert _backward_gather_sizes(model, mesh) == []


@spmd(meshes=[(4,)])
def test_a_kept_block_serves_only_the_backward_of_its_step(mesh):
    rank, ranks = mesh.get_rank(), mesh.size()
    inputs, target = _batches(1)[0]
    local_inputs = _local_batch(inputs, rank, ranks)
    reference, model = _model(), _shard(_model(), mesh, reshard_after_forward=2)
    optimizers = [torch.optim.SGD(module.parameters(), lr=0.1) for module in (reference, model)]
    _loss(reference(inputs), target).backward()
    _loss(model(local_inputs), _local_batch(target, rank, ranks)).backward()
    with torch.no_grad():
        model(local_inputs)  # a forward without backward: every unit keeps its block
    with comm.observe() as explicit:
        model.blocks[0].unshard()
    model.blocks[0].reshard()
    assert _records_by_kind(explicit) == {"all_gather": [4]}  # an explicit unshard reads the sharded parameters
    with torch.no_grad():
        model(local_inputs)
    for optimizer in optimizers:
        optimizer.step()
    with comm.observe() as after_step:
        output = model(local_inputs)
    assert _records_by_kind(after_step) == {"all_gather": [4, 4, 4]}  # the next forward drops the old blocks
    assert_close(output, _local_batch(reference(inputs), rank, ranks))
    with comm.observe() as backward:
        _loss(output, _local_batch(target, rank, ranks)).backward()
    assert _records_by_kind(backward) == {"all_gather": [2, 2, 2], "reduce_scatter": [4, 4, 4]}
    assert all(unit._gathered_state == "sharded" for unit in _units(model))


@spmd(meshes=[(2, 4)], timeout=EIGHT_RANKS_TIMEOUT)
def test_hsdp_reshards_to_two_ranks_within_each_shard_group(mesh):
    batches = _batches(2)
    sharded = _shard(_model(), mesh, reshard_after_forward=2)
    _step_in_lockstep(sharded, _model(), batches, torch.optim.AdamW, mesh.get_rank(), mesh.size())
    rank = mesh.get_rank()
    assert sharded.blocks[0]._fsdp_unit.post_forward.mesh.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]][rank // 2]
    inputs, target = (_local_batch(tensor, rank, mesh.size()) for tensor in batches[0])
    with CommDebugMode() as forward:
        loss = _loss(sharded(inputs), target)
    with CommDebugMode() as backward:
        loss.backward()
    assert _records_by_kind(forward.records) == {"all_gather": [4, 4, 4]}
    assert _records_by_kind(backward.records) == {"all_gather": [2, 2, 2], "reduce_scatter": [4, 4, 4], "all_reduce": [2, 2, 2]}


@spmd(meshes=[(4, 2)], timeout=EIGHT_RANKS_TIMEOUT)
def test_tensor_parallel_parameters_reshard_to_two_data_parallel_ranks(mesh):
    """PyTorch's fully_shard raises NotImplementedError here; ours keeps blocks of the tensor-parallel pieces."""
    from test_fsdp_2d import _named_mesh, _tensor_parallel_model

    mesh = _named_mesh(mesh)
    model = _tensor_parallel_model(mesh["tp"])
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=2)
    data_parallel_rank = mesh.get_coordinate()[0]
    inputs, target = (_local_batch(tensor, data_parallel_rank, 4) for tensor in _batches(1)[0])
    loss = _loss(model(inputs), target)
    with comm.observe() as backward:
        loss.backward()
    data_parallel_gathers = [record.group_size for record in backward if record.kind == "all_gather" and record.mesh_dim_names != ("tp",)]
    assert data_parallel_gathers == [2, 2, 2]
    model = _tensor_parallel_model(mesh["tp"])
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=2)
    _step_in_lockstep(model, _model(), _batches(2), torch.optim.AdamW, data_parallel_rank, 4)


@pytest.mark.parametrize("where", ["checkpoint_wrapper", "around_a_unit", "around_two_units"])
@spmd(meshes=[(4,)])
def test_activation_checkpointing_recomputes_from_the_sub_group_gather(mesh, where):
    from test_user_journeys import _checkpointed_and_sharded

    rank, ranks = mesh.get_rank(), mesh.size()
    model, (forward_gathers, backward_gathers) = _checkpointed_and_sharded(where, mesh, 2)
    for inputs, target in _batches(2):  # the second step prefetches in the recorded order
        model.zero_grad()
        loss = _loss(model(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks))
        with comm.observe() as backward:
            loss.backward()
        assert _records_by_kind(backward) == {"all_gather": [2] * backward_gathers, "reduce_scatter": [4] * forward_gathers}
    reference = _model()  # no optimizer step: the gradients of the last batch
    _loss(reference(_batches(2)[1][0]), _batches(2)[1][1]).backward()
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(parameter.grad.full_tensor(), expected.grad)


@spmd(meshes=[(4,)])
def test_sub_groups_form_when_members_have_seen_different_groups(mesh):
    """Ranks 0 and 1 share a sub-group but not the groups they were in before (a sub-mesh over ranks 0 and
    2): groups made by their members alone would get different hashed names on the two and hang."""
    DeviceMesh("cpu", [0, 2])  # every rank builds it; only ranks 0 and 2 are in its group
    sharded = _shard(_model(), mesh, reshard_after_forward=2)
    _step_in_lockstep(sharded, _model(), _batches(2), torch.optim.SGD, mesh.get_rank(), mesh.size())
