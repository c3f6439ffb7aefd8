"""User journeys, fourth set: programs a demanding PyTorch user writes with features merged on 2026-11-26
(replayed random draws under torch's composable checkpoint with fully_shard and tensor parallelism,
pipeline stages on slices of an 8-rank world, HSDP gathers, CommDebugMode over direct collectives,
0-d tensor operands in a training loop, to_local(grad_placements=...) weights under an optimizer).
Each compares with the single-device program, and where useful with torch's own DTensor/FSDP2 names
on the same ranks."""

import itertools

import torch
import torch.distributed as dist
from helpers import documented_random
from spmd import spmd
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint

import shardtensor
from shardtensor import DTensor, Replicate
from shardtensor.debug import CommDebugMode
from shardtensor.fsdp import fully_shard
from shardtensor.mesh import DeviceMesh
from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardtensor.random import checkpoint_contexts

SEED, STEPS, LEARNING_RATE = 7, 2, 0.1
WIDTH, HIDDEN, BATCH = 6, 8, 8


def _assert_close(ours, expected, what):
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12, msg=lambda message: f"{what}: {message}")


# A torch CommDebugMode key's c10d op (FSDP2 and direct calls: c10d ops; torch DTensor: functional ops) by our kind.
_KIND_OF_TORCH_OP = {"allreduce_": "all_reduce", "broadcast_": "broadcast", "_allgather_base_": "all_gather",
                     "_reduce_scatter_base_": "reduce_scatter", "all_reduce": "all_reduce",
                     "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                     "all_to_all_single": "all_to_all"}


def _kinds(counts) -> dict[str, int]:
    """Either CommDebugMode's counts by our kind (ours are keyed by kind already), zeros dropped."""
    kinds: dict[str, int] = {}
    for key, count in counts.items():
        if count:
            kind = key if isinstance(key, str) and "." not in key else _KIND_OF_TORCH_OP[str(key).split(".")[-1]]
            kinds[kind] = kinds.get(kind, 0) + count
    return kinds


def _mode_kinds(mode) -> dict[str, int]:
    return _kinds(mode.get_comm_counts())


# --- 1. activation checkpointing of blocks with dropout, with fully_shard and tensor parallelism ---------------

class _Block(nn.Module):
    """A transformer-MLP stand-in: up, relu, dropout on the hidden activations, down, dropout, residual."""

    def __init__(self, dropout=nn.functional.dropout):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN, dtype=torch.float64)
        self.down = nn.Linear(HIDDEN, WIDTH, dtype=torch.float64)
        self.dropout = dropout

    def forward(self, x):
        return x + self.dropout(self.down(self.dropout(self.up(x).relu(), 0.5)), 0.25)


def _blocks(dropout=nn.functional.dropout) -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(*(_Block(dropout) for _ in range(2)))


def _documented_dropout(counters):
    """Dropout on one device whose masks are those of shardtensor's random calls `next(counters)`."""
    def dropout(h, p):
        mask = documented_random("rand", h.shape, seed=SEED, counter=next(counters)) < 1 - p
        return h * mask / (1 - p)
    return dropout


def _reference_tp_steps(batch, halves):
    """One device: every step, each of the `halves` data-parallel slices of `batch` runs the model with the
    same dropout masks (each dp rank's tp DTensors take the same random calls), the loss the mean over
    slices of each slice's sum of squares (fully_shard averages the gradients); (losses per slice, params)."""
    draws_per_step = 4
    model = _blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for piece in batch.chunk(halves):
            counters = itertools.count(step * draws_per_step)
            for block in model:
                block.dropout = _documented_dropout(counters)
            output = model(piece)
            step_losses.append((output * output).sum())
        (sum(step_losses) / halves).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack([loss.detach() for loss in step_losses]))
    return losses, [parameter.detach() for parameter in model.parameters()]


def _checkpoint_then_shard(model, tp_mesh, dp_mesh, order, reshard_after_forward=None):
    plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel(use_local_output=False)}
    for block in model:
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, plan)
        if order == "checkpoint first":
            composable_checkpoint(block, context_fn=checkpoint_contexts)
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        else:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
            composable_checkpoint(block, context_fn=checkpoint_contexts)
    fully_shard(model, mesh=dp_mesh)


def _named(mesh, names):
    return DeviceMesh("cpu", mesh.mesh, mesh_dim_names=names)


@spmd(meshes=[(2, 2), (1, 2), (2, 1)], timeout=180.0)
def test_checkpointed_dropout_blocks_with_fully_shard_and_tensor_parallel_train_as_one_device(mesh):
    """fully_shard over "dp" of blocks parallelized over "tp" (Colwise up, Rowwise down, DTensor activations),
    each block under torch's composable checkpoint with checkpoint_contexts (applied before or after
    fully_shard): two SGD steps give each dp slice's loss and the parameters of one device."""
    for order in ("checkpoint first", "fully_shard first"):
        _train_checkpointed_tensor_parallel_blocks(_named(mesh, ("dp", "tp")), order)


def _train_checkpointed_tensor_parallel_blocks(mesh, order):
    """Two SGD steps of the checkpointed blocks, parallelized over mesh["tp"] and sharded over mesh["dp"]."""
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    dp_size, dp_rank = mesh.size(0), mesh.get_local_rank("dp")
    torch.manual_seed(12)
    batch = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    expected_losses, expected_parameters = _reference_tp_steps(batch, dp_size)
    model = _blocks()
    _checkpoint_then_shard(model, tp_mesh, dp_mesh, order)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    shardtensor.manual_seed(SEED)
    x = DTensor.from_local(batch.chunk(dp_size)[dp_rank], tp_mesh, [Replicate()])
    for step in range(STEPS):
        output = model(x)
        loss = (output * output).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _assert_close(loss.full_tensor(), expected_losses[step][dp_rank], f"{order}, loss of step {step}")
    for (name, parameter), expected in zip(model.named_parameters(), expected_parameters):
        _assert_close(parameter.full_tensor(), expected, f"{order}, {name}")


@spmd(meshes=[(2, 2, 2)], timeout=300.0)
def test_checkpointed_dropout_blocks_on_each_pipeline_stage_of_an_eight_rank_world(mesh):
    """The same training on each stage's slice world["dp", "tp"] of a pp x dp x tp world (torchtitan's 3-D
    layout without the hand-off): the stages apply checkpoint and fully_shard in different orders at once;
    on each, the losses and parameters of one device."""
    world = DeviceMesh("cpu", torch.tensor([[[0, 6], [5, 3]], [[7, 1], [2, 4]]]), mesh_dim_names=PIPELINE_NAMES)
    order = ("checkpoint first", "fully_shard first")[world.get_local_rank("pp")]
    _train_checkpointed_tensor_parallel_blocks(world["dp", "tp"], order)


def _reference_plain_dropout_steps(batch, ranks):
    """One device, fully_shard over `ranks` with plain-tensor dropout: slice r's masks come from torch's
    generator as rank r holds it (seeded SEED + r, advanced by its own draws only)."""
    model = _blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    states = []
    for rank in range(ranks):
        torch.manual_seed(SEED + rank)
        states.append(torch.get_rng_state())
    losses = []
    for _ in range(STEPS):
        step_losses = []
        for rank, piece in enumerate(batch.chunk(ranks)):
            torch.set_rng_state(states[rank])
            output = model(piece)
            states[rank] = torch.get_rng_state()
            step_losses.append((output * output).sum())
        (sum(step_losses) / ranks).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack([loss.detach() for loss in step_losses]))
    return losses, [parameter.detach() for parameter in model.parameters()]


@spmd(meshes=[(2,), (4,)], timeout=180.0)
def test_checkpointed_plain_dropout_blocks_with_fully_shard_train_as_one_device(mesh):
    """fully_shard alone (plain activations, dropout from torch's generator, preserved by torch's
    checkpoint), each block under the composable checkpoint with checkpoint_contexts; every reshard choice:
    losses and parameters of one device, the collectives of each step those of torch's FSDP2 without
    checkpointing."""
    torch.manual_seed(12)
    batch = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    expected_losses, expected_parameters = _reference_plain_dropout_steps(batch, mesh.size(0))
    rank = mesh.get_local_rank(0)
    choices = [("checkpoint first", None), ("fully_shard first", None), ("checkpoint first", False)]
    choices += [("checkpoint first", 2), ("fully_shard first", 2)] if mesh.size(0) == 4 else []
    for order, reshard_after_forward in choices:
        model = _blocks()
        _checkpoint_then_shard(model, None, mesh, order, reshard_after_forward)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        torch.manual_seed(SEED + rank)
        counts = []
        for step in range(STEPS):
            with CommDebugMode() as forward:
                output = model(batch.chunk(mesh.size(0))[rank])
                loss = (output * output).sum()
            with CommDebugMode() as backward:
                loss.backward()
            counts.append((_mode_kinds(forward), _mode_kinds(backward)))
            optimizer.step()
            optimizer.zero_grad()
            _assert_close(loss, expected_losses[step][rank], f"{order}, {reshard_after_forward}, loss of step {step}")
        for (name, parameter), expected in zip(model.named_parameters(), expected_parameters):
            _assert_close(parameter.full_tensor(), expected, f"{order}, {reshard_after_forward}, {name}")
        expected_counts = _torch_fsdp_counts(mesh, batch.chunk(mesh.size(0))[rank], reshard_after_forward)
        assert counts == expected_counts, (order, reshard_after_forward, counts, expected_counts)


def _torch_fsdp_counts(mesh, inputs, reshard_after_forward):
    """The collectives of each step of the same model under torch's FSDP2, without checkpointing (torch's
    CommDebugMode raises a KeyError in its module tracker under FSDP2 with the composable checkpoint)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    model = _blocks()
    torch_mesh = TorchDeviceMesh("cpu", mesh.mesh)
    for block in model:
        torch_fully_shard(block, mesh=torch_mesh, reshard_after_forward=reshard_after_forward)
    torch_fully_shard(model, mesh=torch_mesh)
    counts = []
    for _ in range(STEPS):
        with TorchCommDebugMode() as forward:
            output = model(inputs)
            loss = (output * output).sum()
        with TorchCommDebugMode() as backward:
            loss.backward()
        counts.append((_mode_kinds(forward), _mode_kinds(backward)))
    return counts


# --- 2. pipeline stages on slices of a pp x dp x tp world of 8 ranks ---------------------------------------------

PIPELINE_NAMES = ("pp", "dp", "tp")


def _stage_zero_parameters():
    """The first stage's weights (one device): up (HIDDEN x WIDTH), down (WIDTH x HIDDEN), a scalar gain."""
    generator = torch.Generator().manual_seed(21)
    return [torch.randn(HIDDEN, WIDTH, generator=generator, dtype=torch.float64),
            torch.randn(WIDTH, HIDDEN, generator=generator, dtype=torch.float64),
            torch.tensor(1.5, dtype=torch.float64)]


def _stage_zero(x, up, down, gain):
    """relu(x up^T) gain down^T: with x [S(0), R], up [R, S(0)], down [R, S(1)] on (dp, tp), the hidden
    activations are [S(0), S(1)], the gain's gradient Partial over both mesh dims, the output [S(0), P]."""
    return ((x @ up.T).relu() * gain) @ down.T


def _stage_one_model():
    torch.manual_seed(22)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN, dtype=torch.float64), nn.Tanh(),
                         nn.Linear(HIDDEN, WIDTH, dtype=torch.float64))


def _reference_pipeline(batch):
    """Both stages on one device; the loss the sum of squares of the output. The first stage's gradients
    are sums over the batch (its dp reduction sums), the second's means over its 4 ranks (fully_shard's)."""
    stage_zero = [nn.Parameter(tensor.clone()) for tensor in _stage_zero_parameters()]
    stage_one = _stage_one_model()
    losses = []
    for _ in range(STEPS):
        output = stage_one(_stage_zero(batch, *stage_zero))
        loss = (output * output).sum()
        loss.backward()
        with torch.no_grad():
            for parameter in stage_zero:
                parameter -= LEARNING_RATE * parameter.grad
                parameter.grad = None
            for parameter in stage_one.parameters():
                parameter -= LEARNING_RATE * parameter.grad / 4
                parameter.grad = None
        losses.append(loss.detach())
    return losses, [parameter.detach() for parameter in stage_zero], [p.detach() for p in stage_one.parameters()]


@spmd(meshes=[(2, 2, 2)], timeout=300.0)
def test_pipeline_stages_on_slices_hand_off_across_meshes_and_train_as_one_device(mesh):
    """Stage 0 (pp=0) runs a tensor-parallel MLP with a batch split over dp on its slice world["dp", "tp"]
    (the gain's Partial gradient reduced over both mesh dims of the slice); its output moves to stage 1 by a
    cross-mesh redistribute; stage 1 runs fully_shard (HSDP over its slice) on it. Every rank runs the
    backward: the gradient goes back across the meshes. Two SGD steps: losses and parameters of one device.
    On the world in rank order, and in an order where no group over a stage's four ranks exists (with 8 and 7
    rows: uneven shards on both stages)."""
    permuted = torch.tensor([[[0, 6], [5, 3]], [[7, 1], [2, 4]]])
    for ranks, rows, reduce_first in ((mesh.mesh, BATCH, True), (permuted, BATCH, True), (permuted, BATCH - 1, True),
                                      (mesh.mesh, BATCH - 1, False)):  # 7 rows: uneven shards
        _pipeline_steps(DeviceMesh("cpu", ranks, mesh_dim_names=PIPELINE_NAMES), rows, reduce_first)


def _pipeline_steps(world, rows, reduce_first):
    """`reduce_first`: stage 0 reduces its Partial output on its own mesh before the hand-off, else the
    cross-mesh redistribute takes it Partial."""
    from shardtensor import Partial, Shard, distribute_tensor

    stage, pp = world["dp", "tp"], world.get_local_rank("pp")
    stage_meshes = [DeviceMesh("cpu", world.mesh[index], mesh_dim_names=("dp", "tp")) for index in range(2)]
    assert stage == stage_meshes[pp]
    torch.manual_seed(23)
    batch = torch.randn(rows, WIDTH, dtype=torch.float64)
    expected_losses, expected_zero, expected_one = _reference_pipeline(batch)
    R, S = Replicate(), Shard
    hand_off_source, hand_off_target = [S(0), R], [S(0), S(0)]
    if pp == 0:
        parameters = [nn.Parameter(distribute_tensor(tensor, stage, placements)) for tensor, placements in
                      zip(_stage_zero_parameters(), ([R, S(0)], [R, S(1)], [R, R]))]
    else:
        model = _stage_one_model()
        fully_shard(model, mesh=stage)
        parameters = list(model.parameters())
    optimizer = torch.optim.SGD(parameters, lr=LEARNING_RATE)
    for step in range(STEPS):
        if pp == 0:
            x = distribute_tensor(batch, stage, [S(0), R])
            activations = _stage_zero(x, *parameters)
            assert activations.placements == (S(0), Partial()), activations.placements
            if reduce_first:
                activations = activations.redistribute(stage, hand_off_source)
        else:
            empty = torch.empty(0, WIDTH, dtype=torch.float64, requires_grad=True)
            source = hand_off_source if reduce_first else [S(0), Partial()]
            activations = DTensor.from_local(empty, stage_meshes[0], source, shape=batch.shape,
                                             stride=batch.stride())
        received = activations.redistribute(stage_meshes[1], hand_off_target)
        if pp == 1:
            output = model(received.to_local())
            loss = (output * output).sum()
            loss.backward()
            total = loss.detach().clone()
        else:
            torch.autograd.backward([received], [torch.zeros_like(received)])
            total = torch.zeros((), dtype=torch.float64)
        dist.all_reduce(total)  # every rank learns the loss (stage 1's pieces)
        _assert_close(total, expected_losses[step], f"loss of step {step}")
        optimizer.step()
        optimizer.zero_grad()
    expected = expected_zero if pp == 0 else expected_one
    for index, (parameter, reference) in enumerate(zip(parameters, expected)):
        assert parameter.device_mesh == stage
        if pp == 0:
            assert parameter.placements == ((R, S(0)), (R, S(1)), (R, R))[index]
        _assert_close(parameter.full_tensor(), reference, f"stage {pp}, parameter {index}")


# --- 3. HSDP on (dp_replicate, dp_shard), and a 2-D sharded parameter gathered in one collective ------------

def _hsdp_model():
    torch.manual_seed(31)
    return nn.Sequential(nn.Linear(WIDTH, 5, dtype=torch.float64), nn.Tanh(), nn.Linear(5, 3, dtype=torch.float64))


def _shard_units(model, mesh, fully_shard_function):
    for index in (0, 2):
        fully_shard_function(model[index], mesh=mesh)
    fully_shard_function(model, mesh=mesh)
    return model


@spmd(meshes=[(2, 2)], timeout=180.0)
def test_hsdp_step_and_two_dimensional_gathers_against_one_device_and_torch(mesh):
    """HSDP over (dp_replicate, dp_shard), ours and torch's FSDP2 on the same ranks: the collectives of
    forward and backward by kind are torch's, the gradients and the parameters after an SGD step are one
    device's (rows 5 and 3: uneven shards), also on a mesh whose ranks are not in row-major order."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode


    names = ("dp_replicate", "dp_shard")
    rank = dist.get_rank()
    torch.manual_seed(32)
    batch, target = torch.randn(BATCH, WIDTH, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    reference = _hsdp_model()
    losses = [((reference(piece) - goal) ** 2).sum() for piece, goal in zip(batch.chunk(4), target.chunk(4))]
    (sum(losses) / 4).backward()
    expected_grads = [parameter.grad.clone() for parameter in reference.parameters()]
    with torch.no_grad():
        expected_parameters = [parameter - LEARNING_RATE * parameter.grad for parameter in reference.parameters()]
    for ranks in (mesh.mesh, torch.tensor([[3, 1], [2, 0]])):
        ours_mesh = DeviceMesh("cpu", ranks, mesh_dim_names=names)
        torch_mesh = TorchDeviceMesh("cpu", ranks, mesh_dim_names=names)
        index = ranks.flatten().tolist().index(rank)  # this rank's data-parallel slice
        piece, goal = batch.chunk(4)[index], target.chunk(4)[index]
        counts = {}
        models = {"ours": _shard_units(_hsdp_model(), ours_mesh, fully_shard),
                  "torch": _shard_units(_hsdp_model(), torch_mesh, torch_fully_shard)}
        for name, model in models.items():
            mode_class = CommDebugMode if name == "ours" else TorchCommDebugMode
            with mode_class() as forward:
                loss = ((model(piece) - goal) ** 2).sum()
            with mode_class() as backward:
                loss.backward()
            counts[name] = (_mode_kinds(forward), _mode_kinds(backward))
            assert model[0].weight.placements[0].is_replicate() and model[0].weight.placements[1].is_shard(0)
            for parameter, expected in zip(model.parameters(), expected_grads):
                _assert_close(parameter.grad.full_tensor(), expected, f"{name} gradient, mesh {ranks.tolist()}")
            torch.optim.SGD(model.parameters(), lr=LEARNING_RATE).step()
            for parameter, expected in zip(model.parameters(), expected_parameters):
                _assert_close(parameter.full_tensor(), expected, f"{name} parameter, mesh {ranks.tolist()}")
        assert counts["ours"] == counts["torch"] == (
            {"all_gather": 2}, {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}), counts  # two units


@spmd(meshes=[(2, 2)], timeout=180.0)
def test_two_dimensional_shards_of_parameters_gather_in_one_collective(mesh):
    """A parameter laid out [S(0), S(0)] on (dp_replicate, dp_shard) (a 2-D sharded checkpoint, rows 5, 3
    and 8: uneven and even nested shards) gathered to [R, R]: one all_gather over the flattened mesh (torch:
    one per mesh dim), values exact, also on a mesh whose ranks are not in row-major order."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from shardtensor import Shard, distribute_tensor

    parameters = [parameter.detach() for parameter in _hsdp_model().parameters()] + [torch.randn(8, 4)]
    for ranks in (mesh.mesh, torch.tensor([[3, 1], [2, 0]])):
        names = ("dp_replicate", "dp_shard")
        ours_mesh = DeviceMesh("cpu", ranks, mesh_dim_names=names)
        torch_mesh = TorchDeviceMesh("cpu", ranks, mesh_dim_names=names)
        for parameter in parameters:
            ours = distribute_tensor(parameter, ours_mesh, [Shard(0), Shard(0)])
            with CommDebugMode() as gather:
                replicated = ours.redistribute(placements=[Replicate(), Replicate()])
            assert _mode_kinds(gather) == {"all_gather": 1}, (ranks.tolist(), parameter.shape, _mode_kinds(gather))
            assert torch.equal(replicated.to_local(), parameter), (ranks.tolist(), parameter.shape)
            theirs = torch_distribute_tensor(parameter, torch_mesh, [TorchShard(0), TorchShard(0)])
            with TorchCommDebugMode() as torch_gather:
                theirs.redistribute(placements=[TorchReplicate(), TorchReplicate()])
            assert torch_gather.get_total_counts() == 2


# --- 4. a replicated weight read as Partial through local_map and to_local, trained with AdamW -------------------

def _adamw_reference(batch, weight, bias, steps, ranks, foreach):
    """One device: the loss sum(tanh(x w + b)^2) over the whole batch plus an L2 penalty on w."""
    w, b = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())
    optimizer = torch.optim.AdamW([w, b], lr=0.05, foreach=foreach)
    losses = []
    for _ in range(steps):
        loss = (batch @ w + b).tanh().pow(2).sum() + 0.01 * w.pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, [w.detach(), b.detach()]


@spmd(meshes=[(2,), (4,), (2, 2)], timeout=180.0)
def test_weight_read_as_partial_through_local_map_and_to_local_trains_with_adamw_as_one_device(mesh):
    """A Replicate weight and bias used by local_map with in_grad_placements=Partial (each rank's rows give a
    share of the gradient) and by to_local(grad_placements=Partial) in a penalty each rank adds a 1/n share
    of: three AdamW steps (foreach and not) give one device's losses and parameters; the gradients end
    Replicate, so the optimizer's state is Replicate too."""
    from shardtensor import Partial, Shard, distribute_tensor
    from shardtensor.experimental import local_map

    ranks = mesh.size()
    rows, replicate, partial = [Shard(0)] * mesh.ndim, [Replicate()] * mesh.ndim, [Partial()] * mesh.ndim
    generator = torch.Generator().manual_seed(41)
    batch = torch.randn(2 * ranks + 1, 4, generator=generator, dtype=torch.float64)  # uneven rows
    weight = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    bias = torch.randn(3, generator=generator, dtype=torch.float64)
    squares = local_map(lambda x, w, b: (x @ w + b).tanh().pow(2).sum(), out_placements=partial,
                        in_placements=(rows, replicate, replicate), in_grad_placements=(rows, partial, partial))
    for foreach in (False, True):
        expected_losses, expected_parameters = _adamw_reference(batch, weight, bias, 3, ranks, foreach)
        w = nn.Parameter(distribute_tensor(weight, mesh, replicate))
        b = nn.Parameter(distribute_tensor(bias, mesh, replicate))
        x = distribute_tensor(batch, mesh, rows)
        optimizer = torch.optim.AdamW([w, b], lr=0.05, foreach=foreach)
        for step in range(3):
            share = 0.01 * w.to_local(grad_placements=partial).pow(2).sum() / ranks
            loss = squares(x, w, b) + DTensor.from_local(share, mesh, partial)
            loss.full_tensor().backward()
            assert w.grad.placements == b.grad.placements == tuple(replicate), (w.grad.placements, b.grad.placements)
            optimizer.step()
            optimizer.zero_grad()
            _assert_close(loss.full_tensor(), expected_losses[step], f"foreach={foreach}, loss of step {step}")
        for parameter, expected in zip((w, b), expected_parameters):
            assert parameter.placements == tuple(replicate)
            _assert_close(parameter.to_local(), expected, f"foreach={foreach}, parameter")
        assert all(state.placements == tuple(replicate) for state in optimizer.state[w].values()
                   if isinstance(state, DTensor) and state.ndim)


# --- 5. changing 0-d tensor operands in a training loop, Partial inputs included ----------------------------------

@spmd(meshes=[(2,), (2, 2)], timeout=180.0)
def test_changing_zero_dim_tensor_operands_on_partial_inputs_give_one_device_values(mesh):
    """A loop whose 0-d plain tensors change value, sign and dtype every iteration: x * t, x + t, x.add_(t),
    x.mul_(t), torch.where(x > 0, x, t) on Partial(sum/avg/max/min) and Shard inputs: each the one-device
    value (a Partial max times a negative becomes a min; adding to a Partial sum adds once)."""
    from helpers import partial_and_value

    from shardtensor import Shard, distribute_tensor

    values = [2.5, -1.5, 3.0, -0.5, 0.0, 4.0]
    dtypes = [torch.float64, torch.float32, torch.int64, torch.float64, torch.int32, torch.float64]
    for reduce_op in ("sum", "avg", "max", "min"):
        for step, (value, dtype) in enumerate(zip(values, dtypes)):
            scalar = torch.tensor(value).to(dtype)
            x, full = partial_and_value(mesh, (4, 3), reduce_op, seed=step)
            sharded = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
            what = f"{reduce_op}, step {step}, t={value} ({dtype})"
            cases = {
                "x * t": (lambda y: y * scalar, full * scalar),
                "t * x": (lambda y: scalar * y, scalar * full),
                "x + t": (lambda y: y + scalar, full + scalar),
                "x - t": (lambda y: y - scalar, full - scalar),
                "x.add_(t)": (lambda y: y.add_(scalar), full + scalar),
                "x.mul_(t)": (lambda y: y.mul_(scalar), full * scalar),
                "where": (lambda y: torch.where(y > 0, y, scalar), torch.where(full > 0, full, scalar.to(full.dtype))),
            }
            for name, (program, expected) in cases.items():
                for operand in (x, sharded):
                    result = program(operand.clone())
                    assert result.dtype == expected.dtype, (what, name, result.dtype, expected.dtype)
                    _assert_close(result.full_tensor(), expected, f"{what}, {name}, {operand.placements}")


@spmd(meshes=[(2,), (2, 2)], timeout=180.0)
def test_a_plain_zero_dim_learnable_scale_on_dtensor_activations_trains_as_one_device(mesh):
    """A plain 0-d nn.Parameter multiplying DTensor activations (sharded rows, Partial after a rowwise
    contraction), the loss made with a changing 0-d tensor: SGD steps give one device's scale and weight."""
    from shardtensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(51)
    batch = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    reference = [nn.Parameter(torch.tensor(0.7, dtype=torch.float64)), nn.Parameter(weight.clone())]
    scale = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
    w = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)] * mesh.ndim))  # rows: x @ w is Partial
    x = distribute_tensor(batch, mesh, [Shard(1)] * mesh.ndim)
    optimizers = [torch.optim.SGD(reference, lr=0.01), torch.optim.SGD([scale, w], lr=0.01)]
    for step, target in enumerate([1.0, -2.0, 0.5]):
        target = torch.tensor(target, dtype=torch.float64)
        expected = (((batch @ reference[1]) * reference[0] - target) ** 2).sum()
        expected.backward()
        product = x @ w
        assert all(placement.is_partial() for placement in product.placements), product.placements
        loss = ((product * scale - target) ** 2).sum()
        loss.full_tensor().backward()
        assert not isinstance(scale.grad, DTensor)
        _assert_close(scale.grad, reference[0].grad, f"scale's gradient, step {step}")
        _assert_close(w.grad.full_tensor(), reference[1].grad, f"weight's gradient, step {step}")
        _assert_close(loss.full_tensor(), expected.detach(), f"loss, step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _assert_close(scale.detach(), reference[0].detach(), "scale")
    _assert_close(w.full_tensor(), reference[1].detach(), "weight")


@spmd(meshes=[(2,), (2, 2)])
def test_partial_avg_misuse_raises_clearly_and_nonlinear_conversions_reduce_first(mesh):
    """Partial('avg') misuse: an integer operand, a reduce op torch does not name ('mean'), a redistribute
    into a Partial: each raises on every rank saying what is allowed. Conversions that do not commute with
    the reduction (to an integer dtype, bool, round, abs) of Partial(sum/avg) operands give the one-device
    values of the converted reduction, not the reduction of the converted operands."""
    import pytest

    from helpers import partial_and_value

    from shardtensor import Partial, Shard, distribute_tensor

    with pytest.raises(ValueError, match="Partial\\('avg'\\) needs a floating or complex dtype, got torch.int64"):
        DTensor.from_local(torch.arange(4), mesh, [Partial("avg")] * mesh.ndim)
    with pytest.raises(ValueError, match="allowed reduce ops are sum, avg, max, min"):
        Partial("mean")
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)] * mesh.ndim)
    with pytest.raises(ValueError, match="only Shard\\(dim\\) and Replicate\\(\\) targets are allowed"):
        sharded.redistribute(mesh, [Partial("avg")] * mesh.ndim)
    conversions = {"long": lambda y: y.long(), "int32": lambda y: y.to(torch.int32), "bool": lambda y: y.bool(),
                   "round": torch.round, "abs": torch.abs, "float32": lambda y: y.float()}
    for reduce_op in ("sum", "avg"):
        x, full = partial_and_value(mesh, (4, 5), reduce_op, seed=61)
        for name, conversion in conversions.items():
            result = conversion(x)
            expected = conversion(full)
            assert result.dtype == expected.dtype, (reduce_op, name)
            if expected.is_floating_point():  # the reduction's summation order may differ from plain torch's
                _assert_close(result.full_tensor(), expected, f"{reduce_op}, {name}, {result.placements}")
            else:
                assert torch.equal(result.full_tensor(), expected), (reduce_op, name, result.placements)


# --- 6. CommDebugMode over DTensor ops and direct collectives in module and gradient hooks ------------------------

def _phase_kinds(module_counts) -> dict:
    """{module: {phase: {kind: count}}} of either CommDebugMode's per-module counts, empty phases dropped."""
    result = {}
    for module, phases in module_counts.items():
        for phase, counts in phases.items():
            if _kinds(counts):
                result.setdefault(module, {})[phase] = _kinds(counts)
    return result


class _HookedModel(nn.Module):
    """A tensor-parallel MLP (`mlp.up` column-wise, `mlp.down` row-wise) and a plain data-parallel `head` whose
    input is all-reduced by a forward pre-hook, whose output is broadcast by a forward hook (a sync a user
    adds) and whose weight's gradient is all-reduced by a gradient hook (hand-written data parallelism)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(71)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, HIDDEN, dtype=torch.float64), nn.Tanh(),
                                 nn.Linear(HIDDEN, WIDTH, dtype=torch.float64))
        self.head = nn.Linear(WIDTH, 2, dtype=torch.float64)
        self.head.register_forward_pre_hook(lambda module, args: (_all_reduced(args[0]),))
        self.head.register_forward_hook(lambda module, args, output: _broadcast(output))
        self.head.weight.register_hook(lambda grad: _all_reduced(grad))

    def forward(self, x):
        return self.head(self.mlp(x))


def _all_reduced(tensor):
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor


def _broadcast(tensor):
    dist.broadcast(tensor.detach(), 0)  # in place on the values; rank 0's everywhere
    return tensor


@spmd(meshes=[(2,), (4,)], timeout=180.0)
def test_comm_debug_mode_counts_dtensor_ops_and_direct_calls_in_hooks_per_module_as_torch(mesh):
    """The same program with torch's names (parallelize_module, CommDebugMode) and ours: the collectives per
    module and phase agree (the MLP's all_reduce in forward and backward, the head's pre-hook all_reduce and
    forward-hook broadcast in forward, its gradient hook's all_reduce in backward), and so do the outputs and
    the gradients of the head and of the input (the MLP's backward all-reduces the input's gradient)."""
    import torch.distributed.tensor.debug as torch_debug
    import torch.distributed.tensor.parallel as torch_parallel
    from helpers import torch_mesh


    x = torch.randn(3, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(72))
    results = {}
    for name, parallel, mode_class, api_mesh in (
            ("torch", torch_parallel, torch_debug.CommDebugMode, torch_mesh(mesh)),
            ("ours", shardtensor.parallel, CommDebugMode, mesh)):
        model = _HookedModel()
        parallel.parallelize_module(model.mlp, api_mesh, {"0": parallel.ColwiseParallel(),
                                                          "2": parallel.RowwiseParallel()})
        with mode_class() as mode:
            inputs = (x * (dist.get_rank() + 1)).requires_grad_()
            output = model(inputs)
            output.sum().backward()
        counts = mode.comm_module_counts if name == "torch" else mode.get_comm_module_counts()
        results[name] = (_phase_kinds(counts), output.detach(), model.head.weight.grad, inputs.grad)
    theirs, ours = results["torch"], results["ours"]
    assert ours[0] == theirs[0], f"ours {ours[0]}\ntorch {theirs[0]}"
    head = {"forward": {"all_reduce": 1, "broadcast": 1}, "backward": {"all_reduce": 1}}
    whole = {"forward": {"all_reduce": 2, "broadcast": 1}, "backward": {"all_reduce": 2}}
    mlp = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    assert ours[0] == {"Global": whole, "_HookedModel": whole, "_HookedModel.mlp": mlp,
                       "_HookedModel.mlp.0": {"backward": {"all_reduce": 1}},
                       "_HookedModel.mlp.2": {"forward": {"all_reduce": 1}}, "_HookedModel.head": head}, ours[0]
    _assert_close(ours[1], theirs[1], "output")
    _assert_close(ours[2], theirs[2], "head's gradient")
    _assert_close(ours[3], theirs[3], "input's gradient")


# Optimizers whose hyperparameters are 0-d tensors a schedule changes in place between steps.
_TENSOR_HYPERPARAMETER_OPTIMIZERS = {
    "SGD": lambda parameters: torch.optim.SGD(parameters, lr=torch.tensor(0.1, dtype=torch.float64)),
    "SGD momentum": lambda parameters: torch.optim.SGD(parameters, lr=torch.tensor(0.1), momentum=0.9),
    "AdamW": lambda parameters: torch.optim.AdamW(parameters, lr=torch.tensor(0.01), foreach=False),
    "Adam, 0-d betas": lambda parameters: torch.optim.Adam(parameters, lr=torch.tensor(0.01), foreach=False,
                                                          betas=(torch.tensor(0.9), torch.tensor(0.99))),
    "by hand": None,
}


def _train_with_tensor_hyperparameters(weight, batch, make_optimizer):
    """Three steps; the 0-d learning rate halved in place after each, or a step by hand with 0-d tensors
    (w -= lr * grad; w += shift; w *= decay)."""
    optimizer = make_optimizer([weight]) if make_optimizer else None
    for step in range(3):
        ((batch @ weight).tanh() ** 2).sum().backward()
        if optimizer:
            optimizer.step()
            optimizer.zero_grad()
            optimizer.param_groups[0]["lr"].mul_(0.5)
            continue
        with torch.no_grad():
            weight.sub_(torch.tensor(0.1 / (step + 1), dtype=torch.float64) * weight.grad)
            weight.add_(torch.tensor(-0.001 * step))
            weight.mul_(torch.tensor(1.0 - 0.01 * step))
        weight.grad = None
    return weight


@spmd(meshes=[(2,), (2, 2)], timeout=180.0)
def test_zero_dim_tensor_hyperparameters_changed_between_steps_train_as_one_device(mesh):
    from shardtensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(81)
    weight, batch = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in ((5, 3), (6, 5)))
    x = distribute_tensor(batch, mesh, [Shard(0)] * mesh.ndim)
    for name, make_optimizer in _TENSOR_HYPERPARAMETER_OPTIMIZERS.items():
        expected = _train_with_tensor_hyperparameters(nn.Parameter(weight.clone()), batch, make_optimizer)
        for placements in ([Shard(0)], [Replicate()], [Shard(1)]):
            placements = placements * mesh.ndim
            ours = nn.Parameter(distribute_tensor(weight, mesh, placements))
            ours = _train_with_tensor_hyperparameters(ours, x, make_optimizer)
            assert ours.placements == tuple(placements)
            _assert_close(ours.full_tensor(), expected.detach(), f"{name}, {placements}")


class _LocalScale(nn.Module):
    """tanh((x * w) @ lin), x rows sharded over "tp", w and lin Replicate over "tp": `x * w` through local_map
    with w's gradient read as Partial (each rank's rows give a share of it)."""

    def __init__(self, weight, linear, tp_mesh=None):
        super().__init__()
        self.tp_mesh = tp_mesh
        if tp_mesh is not None:
            from shardtensor import Partial, Shard, distribute_tensor
            from shardtensor.experimental import local_map

            weight, linear = (distribute_tensor(tensor, tp_mesh, [Replicate()]) for tensor in (weight, linear))
            self.scale = local_map(torch.mul, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]),
                                   in_grad_placements=([Shard(0)], [Partial()]))
        else:
            self.scale = torch.mul
        self.w, self.lin = nn.Parameter(weight.clone()), nn.Parameter(linear.clone())

    def forward(self, x):
        return (self.scale(x, self.w) @ self.lin).tanh()


@spmd(meshes=[(2, 2), (1, 4)], timeout=180.0)
def test_local_map_partial_gradient_under_checkpoint_and_fully_shard_trains_as_one_device(mesh):
    """The module above under torch's composable checkpoint (its recomputation calls local_map again, in
    backward) and fully_shard over "dp" (w and lin then [S(0), R] on (dp, tp)): two SGD steps give one
    device's parameters, each dp slice's loss a mean term (fully_shard averages)."""
    from shardtensor import Shard, distribute_tensor

    mesh = _named(mesh, ("dp", "tp"))
    dp_size = mesh.size(0)
    generator = torch.Generator().manual_seed(91)
    weight, linear, batch = (torch.randn(shape, generator=generator, dtype=torch.float64)
                             for shape in ((4,), (4, 4), (8, 4)))
    reference = _LocalScale(weight, linear)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LEARNING_RATE)
    for _ in range(STEPS):
        (sum((reference(piece) ** 2).sum() for piece in batch.chunk(dp_size)) / dp_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    model = _LocalScale(weight, linear, mesh["tp"])
    composable_checkpoint(model, context_fn=checkpoint_contexts)
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    x = distribute_tensor(batch.chunk(dp_size)[mesh.get_local_rank("dp")], mesh["tp"], [Shard(0)])
    for _ in range(STEPS):
        (model(x) ** 2).sum().full_tensor().backward()
        optimizer.step()
        optimizer.zero_grad()
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        assert parameter.placements == (Shard(0), Replicate()), (name, parameter.placements)
        _assert_close(parameter.full_tensor(), expected.detach(), name)


@spmd(meshes=[(2,), (2, 2)])
def test_optimizer_in_backward_on_a_weight_read_as_partial_steps_with_the_whole_gradient(mesh):
    """The optimizer-in-backward pattern (a post-accumulate-grad hook steps and zeroes) on a Replicate weight
    read as Partial through to_local: the hooks see the Partial gradient (as in torch, before our end of
    backward reduces it), and the step uses the whole gradient: three AdamW steps give one device's weight."""
    from shardtensor import Partial, distribute_tensor

    partial = [Partial()] * mesh.ndim
    generator = torch.Generator().manual_seed(95)
    weight = torch.randn(3, generator=generator, dtype=torch.float64)
    inputs = torch.randn(mesh.size(), 3, generator=generator, dtype=torch.float64)  # a row per rank
    reference = nn.Parameter(weight.clone())
    reference_optimizer = torch.optim.AdamW([reference], lr=0.1)
    w = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()] * mesh.ndim))
    optimizer = torch.optim.AdamW([w], lr=0.1)
    seen = []

    def step_in_backward(parameter):
        seen.append(parameter.grad.placements)
        optimizer.step()
        optimizer.zero_grad()

    w.register_post_accumulate_grad_hook(step_in_backward)
    row = inputs[dist.get_rank()]
    for _ in range(3):
        (inputs @ reference).tanh().sum().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        share = (row @ w.to_local(grad_placements=partial)).tanh()
        DTensor.from_local(share, mesh, partial).full_tensor().backward()
        assert w.grad is None
    assert seen == [tuple(partial)] * 3, seen
    _assert_close(w.to_local(), reference.detach(), "weight")
