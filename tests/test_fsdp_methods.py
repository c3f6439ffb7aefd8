"""FSDPModule's smaller methods and `register_fsdp_forward_method`, each against single-device values and
exact collective counts."""

import pytest
import torch
from spmd import spmd
from test_fsdp import Model, _assert_same_parameters, _batches, _kinds, _local_batch, _loss, _model, _shard, _train_reference
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, comm
from shardtensor.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method


class Encoder(Model):
    """`Model` with a second entry point that uses the root unit's parameters only."""

    def encode(self, x):
        return torch.tanh(self.embed(x))


def _encoder() -> Encoder:
    torch.manual_seed(0)
    return Encoder().double()


def _local_inputs(mesh, micro_batch: int = 0):
    rank, ranks = mesh.get_rank(), mesh.size()
    return [(_local_batch(inputs, rank, ranks), _local_batch(target, rank, ranks))
            for inputs, target in _batches(micro_batch + 1)][micro_batch]


@spmd(meshes=[(2,)])
def test_registered_forward_method_gathers_and_reduces_like_forward(mesh):
    reference, sharded = _encoder(), _shard(_encoder(), mesh)
    register_fsdp_forward_method(sharded, "encode")
    inputs, _ = _batches(1)[0]
    local = _local_batch(inputs, mesh.get_rank(), mesh.size())
    with comm.observe() as forward:
        encoded = sharded.encode(local)
    assert _kinds(forward) == {"all_gather": 1}  # the root unit only: the blocks do not run
    with comm.observe() as backward:
        encoded.sum().backward()
    assert _kinds(backward) == {"reduce_scatter": 1}  # the blocks' units took no part
    reference.encode(inputs).sum().backward()
    assert_close(encoded, _local_batch(reference.encode(inputs), mesh.get_rank(), mesh.size()))
    # The data-parallel gradient averages the ranks' gradients of their local sums.
    assert_close(sharded.embed.weight.grad.full_tensor(), reference.embed.weight.grad / mesh.size())
    plain = _encoder()
    register_fsdp_forward_method(plain, "encode")  # a no-op on a module without fully_shard
    assert "encode" not in vars(plain)
    with pytest.raises(ValueError, match="has no method 'decode'"):
        register_fsdp_forward_method(sharded, "decode")


@spmd(meshes=[(2,), (2, 2)])
def test_all_reduce_hook_sees_the_summed_pieces_before_the_division(mesh):
    inputs, target = _local_inputs(mesh)
    plain, hooked = _shard(_model(), mesh), _shard(_model(), mesh)
    calls = []

    def double(reduced: torch.Tensor) -> None:
        calls.append(reduced.numel())
        reduced.mul_(2)

    for module in hooked.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(double)
    for model in (plain, hooked):
        _loss(model(inputs), target).backward()
    assert len(calls) == 3  # once per unit
    for once, twice in zip(plain.parameters(), hooked.parameters(), strict=True):
        assert_close(twice.grad.full_tensor(), once.grad.full_tensor() * 2)
    with pytest.raises(ValueError, match="stream is not supported"):
        hooked.set_all_reduce_hook(double, stream=object())


@spmd(meshes=[(2, 2)])
def test_hsdp_without_all_reduce_accumulates_and_all_reduces_once(mesh):
    micro_batches = 3
    reference = _model()
    for inputs, target in _batches(micro_batches):
        _loss(reference(inputs), target).backward()
    sharded = _shard(_model(), mesh)
    for index in range(micro_batches):
        last = index == micro_batches - 1
        sharded.set_requires_all_reduce(last)
        inputs, target = _local_inputs(mesh, index)
        with comm.observe() as records:
            _loss(sharded(inputs), target).backward()
        assert _kinds(records) == {"all_gather": 5, "reduce_scatter": 3, **({"all_reduce": 3} if last else {})}
        if not last:
            assert all(parameter.grad is None for parameter in sharded.parameters())
    for (name, parameter), expected in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        assert_close(parameter.grad.full_tensor(), expected.grad, msg=name)


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 6, dtype=torch.float64)
        self.head = nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, indices):
        return self.head(self.embedding(indices))


@spmd(meshes=[(2,)])
def test_no_unshard_in_backward_skips_the_gather(mesh):
    indices = torch.tensor([[1, 4, 4], [9, 0, 2]])
    reference, sharded = Embedder(), Embedder()
    fully_shard(sharded.embedding, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded.embedding.set_unshard_in_backward(False)
    output = sharded(indices)
    with comm.observe() as backward:
        output.sum().backward()
    assert _kinds(backward) == {"reduce_scatter": 2}  # no all_gather: the embedding's backward needs no weight
    reference(indices).sum().backward()
    for parameter, expected in zip(sharded.parameters(), reference.parameters(), strict=True):
        assert_close(parameter.grad.full_tensor(), expected.grad)  # every rank has the same indices


class Failing(Model):
    """`Model` whose second block raises once, in the middle of a forward."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            x = self.blocks[0](self.embed(x))
            self.fail = False
            raise RuntimeError("failed mid-forward")
        return super().forward(x)


@spmd(meshes=[(2,)])
def test_reset_iter_state_after_a_failed_forward(mesh):
    batches = _batches(2)
    reference = _train_reference(_model(), batches)
    torch.manual_seed(0)
    sharded = _shard(Failing().double(), mesh)
    inputs, _ = _local_inputs(mesh)
    sharded(inputs)  # a first step makes this module the root
    sharded.fail = True
    with pytest.raises(RuntimeError, match="failed mid-forward"):
        sharded(inputs)
    with pytest.raises(RuntimeError, match="call it on the root"):
        sharded.blocks[0].reset_iter_state()
    sharded.reset_iter_state()
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    for index in range(len(batches)):
        inputs, target = _local_inputs(mesh, index)
        with comm.observe() as records:
            _loss(sharded(inputs), target).backward()
        assert _kinds(records) == {"all_gather": 5, "reduce_scatter": 3}
        optimizer.step()
        optimizer.zero_grad()
    _assert_same_parameters(sharded, reference)


@spmd(meshes=[(2,)])
def test_methods_that_only_accept_what_is_always_true_here(mesh):
    inputs, target = _local_inputs(mesh)
    averaged, renamed = _shard(_model(), mesh), _shard(_model(), mesh)
    with pytest.warns(FutureWarning, match="use set_gradient_divide_factor"):
        renamed.set_reduce_scatter_divide_factor(1.0)
    renamed.set_force_sum_reduction_for_comms(True)
    renamed.set_is_last_backward(False)
    renamed.set_reduce_scatter_unused_params(True)
    for model in (averaged, renamed):
        _loss(model(inputs), target).backward()
    assert_close(renamed.head.weight.grad.full_tensor(), averaged.head.weight.grad.full_tensor() * mesh.size())
    with pytest.raises(TypeError, match="takes a bool"):
        renamed.set_is_last_backward(1)
    with pytest.raises(NotImplementedError, match="only True is supported"):
        renamed.set_reduce_scatter_unused_params(False)


@spmd(meshes=[(2,)])
def test_keep_unsharded_storage_keeps_data_pointers_and_trains_like_one_device(mesh):
    """`set_keep_unsharded_storage(True)` (torch 2.15's name): every forward gathers into the same storage (the
    unsharded parameters' data pointers do not change between steps), outside forward the modules show the
    sharded parameters as before, and two AdamW steps equal one device's."""
    batches = _batches(2)
    reference = _train_reference(_model(), batches)
    sharded = _shard(_model(), mesh)
    sharded.set_keep_unsharded_storage(True)
    freed = _shard(_model(), mesh)  # the default, for comparison: resharding frees the storage
    gathered = {id(sharded): [], id(freed): []}
    for model in (sharded, freed):
        model.blocks[0].register_forward_pre_hook(
            lambda module, args, key=id(model): gathered[key].append(list(module.parameters())))
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    for index in range(len(batches)):
        inputs, target = _local_inputs(mesh, index)
        _loss(sharded(inputs), target).backward()
        _loss(freed(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert all(isinstance(parameter, DTensor) for parameter in sharded.blocks[0].parameters())
        assert all(tensor.untyped_storage().nbytes() > 0 for tensor in gathered[id(sharded)][-1])
        assert all(tensor.untyped_storage().nbytes() == 0 for tensor in gathered[id(freed)][-1])
    first, second = ([tensor.data_ptr() for tensor in step] for step in gathered[id(sharded)])
    assert first == second
    _assert_same_parameters(sharded, reference)
    with pytest.raises(TypeError, match="takes a bool"):
        sharded.set_keep_unsharded_storage(1)
