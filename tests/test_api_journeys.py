"""The API surface users of torch's tensor parallelism and debug/experimental tools call, each program
written once and run twice on the same gloo ranks: with torch's `torch.distributed.tensor` names (the
oracle) and with shardtensor's. Outputs, gradients, placements and collectives (each library's own
CommDebugMode, by c10d name) must agree. End-to-end training is in test_user_journeys*.py.

Deliberate differences from torch, asserted where they show:
- A leaf's gradient comes back in the leaf's placements (`gradients.py`): a Partial gradient of a
  Replicate leaf is reduced when backward ends, in one all_reduce per bucket, and a Replicate or Shard(1)
  gradient of a differently laid out leaf is moved; torch keeps the gradient as the last op made it.
- A plan key that matches no submodule raises (torch warns and skips the entry).
- A plain tensor a style reads as Shard(dim) along a dim the module does not define (a batch-sharded
  input of ColwiseParallel(input_layouts=Shard(0))) costs ours a size agreement (1 all_gather), so that
  uneven shards are exact; torch assumes every rank's shard has this rank's shape. The same holds for
  `DTensor.from_local` without `shape` (run_check or not) and local_map's Shard outputs
  (`out_shard_sizes="chunk"` skips it, as torch does).
"""

import typing

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (torch.ops.c10d_functional, read by a program)
import torch.nn.functional as F
from helpers import local_piece, torch_collectives, torch_mesh
from spmd import spmd
from torch import nn
from torch.testing import assert_close

import shardtensor
import shardtensor.debug
import shardtensor.experimental
import shardtensor.parallel
from shardtensor.debug.tracing_table import C10D_NAMES


class Api(typing.NamedTuple):
    """One library's names, as a program imports them, and the mesh it runs on."""

    name: str
    tensor: typing.Any  # torch.distributed.tensor or shardtensor
    parallel: typing.Any
    debug: typing.Any
    experimental: typing.Any
    mesh: typing.Any


def _apis(mesh) -> tuple[Api, Api]:
    import torch.distributed.tensor as theirs
    import torch.distributed.tensor.debug
    import torch.distributed.tensor.experimental
    import torch.distributed.tensor.parallel  # noqa: F401

    return (
        Api("torch", theirs, theirs.parallel, theirs.debug, theirs.experimental, torch_mesh(mesh)),
        Api("ours", shardtensor, shardtensor.parallel, shardtensor.debug, shardtensor.experimental, mesh),
    )


def _c10d_name(api: Api, key) -> str:
    """A key of either CommDebugMode's counts (our kind; torch's op or its name) as its c10d name."""
    return C10D_NAMES[key] if api.name == "ours" else str(key).split(".")[-1].rstrip("_")


def _kinds(api: Api, mode) -> dict[str, int]:
    """Collectives by c10d name (`all_reduce`, `all_gather_into_tensor`, ...) from either CommDebugMode."""
    return {_c10d_name(api, key): count for key, count in mode.get_comm_counts().items() if count}


def _both(mesh, setup, step) -> tuple:
    """(torch's result, our result, torch's collectives, ours): `step(api, setup(api))`, the step run
    under each library's CommDebugMode."""
    results, counts = [], []
    for api in _apis(mesh):
        state = setup(api)
        with api.debug.CommDebugMode() as mode:
            results.append(step(api, state))
        counts.append(_kinds(api, mode))
    return results[0], results[1], counts[0], counts[1]


def _value(x):
    """A DTensor's global value (either library), a plain tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def _placements(x) -> tuple[str, ...] | str:
    """Placements as text (`S(0)`, `R`, `P(sum)`), or "plain" for a plain tensor."""
    return tuple(str(p) for p in x.placements) if hasattr(x, "placements") else "plain"


def _same(theirs, ours, what: str = "", placements_differ: dict | None = None):
    """Values and placements of two pytrees of tensors agree; `placements_differ` maps a leaf's index to
    (torch's placements, ours) where ours differ deliberately."""
    theirs_flat, ours_flat = torch.utils._pytree.tree_leaves(theirs), torch.utils._pytree.tree_leaves(ours)
    assert len(theirs_flat) == len(ours_flat), f"{what}: {ours} against torch's {theirs}"
    for index, (their, our) in enumerate(zip(theirs_flat, ours_flat)):
        where = f"{what}, leaf {index}"
        if isinstance(their, torch.Tensor):
            expected = (placements_differ or {}).get(index, (_placements(their),) * 2)
            got = (_placements(their), _placements(our))
            assert got == expected, f"{where}: placements (torch, ours) {got}, expected {expected}"
            assert_close(_value(our), _value(their), rtol=1e-12, atol=1e-12, msg=lambda m: f"{where}: {m}")
        else:
            assert our == their, f"{where}: ours {our!r}, torch {their!r}"


def _same_counts(ours: dict, theirs: dict, expected: dict, what: str = "") -> None:
    """Our collectives are torch's and the expected ones (by c10d name)."""
    assert ours == theirs == expected, f"{what}: ours {ours}, torch {theirs}, expected {expected}"


def _without(counts: dict, extra: dict | None = None) -> dict:
    """`counts` less the `extra` collectives ours issues deliberately (see the module docstring)."""
    left = {kind: count - (extra or {}).get(kind, 0) for kind, count in counts.items()}
    return {kind: count for kind, count in left.items() if count}


def _parameters_and_grads(module: nn.Module) -> dict:
    return {name: (p, p.grad) for name, p in module.named_parameters()}


# --- parallelize_module -----------------------------------------------------------------------------------

DIM = 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wo = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        return self.wo(torch.tanh(self.wq(x)) * self.wk(x))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stack() -> Stack:
    torch.manual_seed(0)
    return Stack().to(torch.float64)


@spmd(meshes=[(2,)])
def test_wildcard_nested_and_parent_child_plans(mesh):
    """One model, three spellings of a Megatron plan: wildcard FQNs, a nested dict per block, and a plan
    with an entry for the root (key "") and for a parent and its children. Same values, gradients,
    parameter placements and collectives as torch (2 all_reduces per block forward, 2 in backward)."""
    plans = {
        "wildcards": lambda a: {
            "layers.*.attention.wq": a.parallel.ColwiseParallel(), "layers.*.attention.wk": a.parallel.ColwiseParallel(),
            "layers.*.attention.wo": a.parallel.RowwiseParallel(),
            "layers.*.mlp.up": a.parallel.ColwiseParallel(), "layers.*.mlp.down": a.parallel.RowwiseParallel(),
        },
        "nested": lambda a: {
            "layers": {"0": {"attention": {"w[qk]": a.parallel.ColwiseParallel(), "wo": a.parallel.RowwiseParallel()},
                             "mlp": {"up": a.parallel.ColwiseParallel(), "down": a.parallel.RowwiseParallel()}},
                       "1.attention": {"w[qk]": a.parallel.ColwiseParallel(), "wo": a.parallel.RowwiseParallel()},
                       "1.mlp": {"up": a.parallel.ColwiseParallel(), "down": a.parallel.RowwiseParallel()}},
        },
        "root_parent_children": lambda a: {
            "": a.parallel.PrepareModuleInput(input_layouts=(a.tensor.Replicate(),), desired_input_layouts=(a.tensor.Replicate(),),
                                                use_local_output=True),
            "layers.*": a.parallel.PrepareModuleInput(input_layouts=(a.tensor.Replicate(),), desired_input_layouts=(a.tensor.Replicate(),),
                                                use_local_output=True),
            "layers.*.attention.wq": a.parallel.ColwiseParallel(), "layers.*.attention.wk": a.parallel.ColwiseParallel(),
            "layers.*.attention.wo": a.parallel.RowwiseParallel(),
            "layers.*.mlp": a.parallel.PrepareModuleOutput(output_layouts=(a.tensor.Replicate(),), desired_output_layouts=(a.tensor.Replicate(),)),
            "layers.*.mlp.up": a.parallel.ColwiseParallel(), "layers.*.mlp.down": a.parallel.RowwiseParallel(),
        },
    }
    x = torch.randn(3, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for spelling, plan in plans.items():
        def setup(api):
            return api.parallel.parallelize_module(_stack(), api.mesh, plan(api))

        def step(api, model):
            out = model(x)
            out.pow(2).sum().backward()
            return out, _parameters_and_grads(model)

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        _same(theirs, ours)
        _same_counts(our_counts, their_counts, {"all_reduce": 8}, spelling)
    misspelt = {"layers.*.attn.wq": None}
    for api in _apis(mesh):
        misspelt["layers.*.attn.wq"] = api.parallel.ColwiseParallel()
        if api.name == "torch":
            with pytest.warns(UserWarning, match="could not be resolved"):
                api.parallel.parallelize_module(_stack(), api.mesh, misspelt)
        else:
            with pytest.raises(KeyError, match="matches no submodule"):
                api.parallel.parallelize_module(_stack(), api.mesh, misspelt)



def _chunk(x: torch.Tensor, mesh, dim: int) -> torch.Tensor:
    """This rank's `torch.chunk` piece of `x` along `dim` (a 1-D mesh)."""
    return x.chunk(mesh.size(0), dim)[mesh.get_local_rank(0)]


# A plain input read as Shard(dim) along a dim the module does not define: our style learns the exact
# global size from every rank's local shape (one all_gather of fixed-size records), torch assumes even shards.
_SIZE_AGREEMENT = {"all_gather_into_tensor": 1}

# The vocabulary-sharded embedding's weight gradient: ours keeps the weight's Shard(0) (each rank's rows,
# no collective), torch's comes out Replicate (every rank holds the whole gradient, the optimizer step then
# mixes a Shard(0) weight with it). Leaf 2 is the weight's gradient.
_ROW_SHARDED_GRAD = {2: (("R",), ("S(0)",))}

# (name, module, style from the api, input dim chunked (None: the whole input), torch's collectives in
# forward + backward[, our extra collectives[, {leaf: (torch's placements, ours)} where they differ]])
_STYLE_VARIANTS = [
    ("colwise", "linear", lambda a: a.parallel.ColwiseParallel(), None, {"all_reduce": 1}),
    ("colwise_replicate_out", "linear", lambda a: a.parallel.ColwiseParallel(output_layouts=a.tensor.Replicate()),
     None, {"all_gather_into_tensor": 1, "all_reduce": 1}),
    ("colwise_dtensor_out", "linear", lambda a: a.parallel.ColwiseParallel(use_local_output=False), None,
     {"all_reduce": 1}),
    ("colwise_batch_sharded_in", "linear", lambda a: a.parallel.ColwiseParallel(input_layouts=a.tensor.Shard(0)),
     0, {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, _SIZE_AGREEMENT),
    ("rowwise", "linear", lambda a: a.parallel.RowwiseParallel(), -1, {"all_reduce": 1}),
    ("rowwise_replicate_in", "linear", lambda a: a.parallel.RowwiseParallel(input_layouts=a.tensor.Replicate()),
     None, {"all_reduce": 1, "all_gather_into_tensor": 1}),
    ("rowwise_sequence_out", "linear",
     lambda a: a.parallel.RowwiseParallel(output_layouts=a.tensor.Shard(0), use_local_output=False),
     -1, {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}),
    ("rowwise_embedding", "embedding", lambda a: a.parallel.RowwiseParallel(input_layouts=a.tensor.Replicate()),
     None, {"all_reduce": 1}, None, _ROW_SHARDED_GRAD),
    ("rowwise_embedding_sequence_out", "embedding",
     lambda a: a.parallel.RowwiseParallel(input_layouts=a.tensor.Replicate(), output_layouts=a.tensor.Shard(1)),
     None, {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}, None, _ROW_SHARDED_GRAD),
    ("colwise_embedding", "embedding", lambda a: a.parallel.ColwiseParallel(), None, {}),
    ("colwise_embedding_replicate_out", "embedding",
     lambda a: a.parallel.ColwiseParallel(output_layouts=a.tensor.Replicate()), None, {"all_gather_into_tensor": 1}),
]


def _style_module(kind: str) -> nn.Module:
    torch.manual_seed(2)
    module = nn.Linear(DIM, 6) if kind == "linear" else nn.Embedding(10, DIM)
    return module.to(torch.float64)


@spmd(meshes=[(2,)])
def test_colwise_rowwise_variants_on_linear_and_embedding(mesh):
    """ColwiseParallel / RowwiseParallel with input_layouts, output_layouts and use_local_output, on
    nn.Linear and nn.Embedding (Rowwise: vocabulary-sharded lookup, masked and summed): the output's value,
    type and placements, the gradients of the parameters and of a float input, and the collectives of
    forward and backward are torch's."""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(4, 2, DIM, dtype=torch.float64, generator=generator)
    tokens = torch.randint(0, 10, (4, 2), generator=generator)
    for name, kind, style, input_dim, expected, *options in _STYLE_VARIANTS:
        extra, placements_differ = (options + [None, None])[:2]
        def setup(api):
            module = api.parallel.parallelize_module(_style_module(kind), api.mesh, style(api))
            if kind == "embedding":
                return module, tokens
            x = features if input_dim is None else _chunk(features, mesh, input_dim)
            return module, x.clone().requires_grad_()

        def step(api, state):
            module, x = state
            out = module(x)
            out.pow(2).sum().backward()
            return out, _parameters_and_grads(module), x.grad

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        _same(theirs, ours, name, placements_differ)
        _same_counts(_without(our_counts, extra), their_counts, expected, name)


@spmd(meshes=[(2,)])
def test_sequence_parallel_norms(mesh):
    """SequenceParallel on nn.LayerNorm and on a norm written in Python, given a sequence-sharded DTensor
    (and a plain local shard, with use_local_output): torch's outputs and gradients. Ours reduces the
    norm's weight and bias gradients when backward ends (one all_reduce for the module, Replicate like the
    parameters); torch leaves them Partial(sum), to be reduced by whoever reads them."""

    class ScaleNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, DIM, dtype=torch.float64))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    x = torch.randn(2, 4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cases = [
        ("layer_norm", lambda: nn.LayerNorm(DIM, dtype=torch.float64), {}, {1: ("P(sum)",), 2: ("P(sum)",)}),
        ("python_norm", ScaleNorm, {}, {1: ("P(sum)",)}),
        ("local_output", lambda: nn.LayerNorm(DIM, dtype=torch.float64), {"use_local_output": True},
         {1: ("P(sum)",), 2: ("P(sum)",)}),
    ]
    for name, make, options, partial_grads in cases:
        def setup(api):
            torch.manual_seed(5)
            norm = api.parallel.parallelize_module(make(), api.mesh, api.parallel.SequenceParallel(**options))
            if options:
                return norm, _chunk(x, mesh, 1).clone().requires_grad_()
            return norm, api.tensor.distribute_tensor(x, api.mesh, [api.tensor.Shard(1)]).requires_grad_()

        def step(api, state):
            norm, given = state
            out = norm(given)
            out.pow(3).sum().backward()
            return out, [parameter.grad for parameter in norm.parameters()], given.grad

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        # Leaves: the output, the parameters' gradients (1, 2), the input's gradient.
        differ = {leaf: (placements, ("R",)) for leaf, placements in partial_grads.items()}
        _same(theirs, ours, name, differ)
        size_agreement = _SIZE_AGREEMENT if options else {}
        _same_counts(_without(our_counts, {"all_reduce": 1, **size_agreement}), their_counts, {}, name)


class _Gate(nn.Module):
    """forward(x, y, *, scale, mask=None): positional and keyword tensor inputs, two outputs."""

    def forward(self, x, y, *, scale, mask=None):
        gated = x * torch.sigmoid(y) * scale
        if mask is not None:
            gated = gated * mask
        return gated, gated.sum(-1, keepdim=True)


@spmd(meshes=[(2,)])
def test_prepare_module_input_output_with_kwargs(mesh):
    """PrepareModuleInput with positional layouts (None: left alone) and input_kwarg_layouts /
    desired_input_kwarg_layouts, PrepareModuleOutput on a tuple of outputs, and PrepareModuleInputOutput
    (use_local_input): the values, types, placements and gradients that reach and leave the module, and
    the collectives, are torch's."""
    generator = torch.Generator().manual_seed(6)
    x, y = (torch.randn(4, DIM, dtype=torch.float64, generator=generator) for _ in range(2))
    scale, mask = torch.randn(DIM, dtype=torch.float64, generator=generator), (torch.rand(4, DIM, generator=generator) > 0.3).double()

    def styles(a):
        S, R = a.tensor.Shard, a.tensor.Replicate
        prepare_input = dict(input_layouts=(S(0), None), desired_input_layouts=(R(), None),
                             input_kwarg_layouts={"scale": R(), "mask": S(1)},
                             desired_input_kwarg_layouts={"scale": R(), "mask": R()})
        # The module computes with DTensors: every input made one (torch refuses mixing them with plain tensors).
        all_dtensors = dict(prepare_input, input_layouts=(S(0), R()), desired_input_layouts=(R(), R()))
        return {
            "input": a.parallel.PrepareModuleInput(**all_dtensors),
            "input_local": a.parallel.PrepareModuleInput(**prepare_input, use_local_output=True),
            "output": a.parallel.PrepareModuleOutput(output_layouts=(S(0), R()), desired_output_layouts=(R(), S(0))),
            "output_dtensors": a.parallel.PrepareModuleOutput(output_layouts=(S(1), None), desired_output_layouts=(R(), None),
                                                              use_local_output=False),
            "input_output": a.parallel.PrepareModuleInputOutput(
                **prepare_input, use_local_input=True, output_layouts=(R(), R()), desired_output_layouts=(S(1), S(0)),
                use_local_output=False),
        }

    # Collectives of forward + backward, by torch: the sharded inputs gathered (their gradients are cut
    # locally), the outputs moved. Ours learns the sizes of the plain tensors read as sharded first.
    expected = {
        "input": {"all_gather_into_tensor": 2},
        "input_local": {"all_gather_into_tensor": 2},
        "output": {"all_gather_into_tensor": 2},
        "output_dtensors": {"all_gather_into_tensor": 1},
        "input_output": {"all_gather_into_tensor": 4},
    }
    agreements = {"input": 2, "input_local": 2, "output": 1, "output_dtensors": 1, "input_output": 2}
    for name in expected:
        def setup(api):
            module = api.parallel.parallelize_module(_Gate(), api.mesh, styles(api)[name])
            seen = []
            module.register_forward_pre_hook(lambda m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
            if name.startswith("input"):
                inputs = [_chunk(x, mesh, 0), y, scale, _chunk(mask, mesh, 1)]
            else:
                inputs = [x, y, scale, mask]
            return module, [t.clone().requires_grad_() for t in inputs[:2]] + inputs[2:], seen

        def step(api, state):
            module, (x_in, y_in, scale_in, mask_in), seen = state
            outputs = module(x_in, y_in, scale=scale_in, mask=mask_in)
            local = [output.to_local() if hasattr(output, "to_local") else output for output in outputs]
            loss = local[0].pow(2).sum() + local[1].sum()
            loss.backward()
            return seen, outputs, x_in.grad, y_in.grad

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        _same(theirs, ours, name)
        extra = {"all_gather_into_tensor": agreements[name] * _SIZE_AGREEMENT["all_gather_into_tensor"]}
        _same_counts(_without(our_counts, extra), their_counts, expected[name], name)


@spmd(meshes=[(2,)])
def test_loss_parallel_reductions_and_ignore_index(mesh):
    """loss_parallel over class-sharded logits from ColwiseParallel(use_local_output=False): cross_entropy
    with reduction none/sum/mean, with and without ignore_index (targets equal to it, and mean over the
    rest), class weights, on rows (batch * sequence, classes) and on a sequence (batch, classes,
    sequence), and backward inside the context as torch requires: torch's losses, placements, gradients
    and collectives."""
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(2, 3, DIM, dtype=torch.float64, generator=generator)
    target = torch.randint(0, 10, (2, 3), generator=generator)
    target[0, 1] = target[1, 2] = 3
    weight = torch.rand(10, dtype=torch.float64, generator=generator) + 0.5
    cases = [(reduction, ignore_index, weighted, "rows") for reduction in ("none", "sum", "mean")
             for ignore_index, weighted in ((-100, False), (3, False), (3, True))]
    cases += [("none", -100, False, "sequence"), ("sum", 3, False, "sequence"), ("mean", 3, True, "sequence")]
    for reduction, ignore_index, weighted, shape in cases:
        name = f"reduction={reduction} ignore_index={ignore_index} weighted={weighted} {shape}"

        def setup(api):
            torch.manual_seed(8)
            head = nn.Linear(DIM, 10, dtype=torch.float64)
            return api.parallel.parallelize_module(head, api.mesh, api.parallel.ColwiseParallel(use_local_output=False))

        def step(api, head):
            x = features.clone().requires_grad_()
            with api.parallel.loss_parallel():
                logits = head(x)  # (batch, sequence, classes)
                if shape == "rows":
                    logits, labels = logits.flatten(0, 1), target.flatten()
                else:  # (batch, classes, sequence), as F.cross_entropy takes a sequence of classes
                    logits, labels = logits.transpose(1, 2), target
                loss = F.cross_entropy(logits, labels, weight=weight if weighted else None,
                                       reduction=reduction, ignore_index=ignore_index)
                (loss.sum() if reduction == "none" else loss).backward()
            return loss, x.grad, _parameters_and_grads(head)

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        _same(theirs, ours, name)
        # Forward: the max, the sum of exponentials, the picked targets; backward: the input's gradient.
        _same_counts(our_counts, their_counts, {"all_reduce": 4}, name)


@spmd(meshes=[(2,)])
def test_src_data_rank_none(mesh):
    """src_data_rank=None: distribute_tensor and parallelize_module take each rank's own values without
    communicating (rank r's shard is cut from rank r's tensor); src_data_rank=1 sends rank 1's values."""
    rank = mesh.get_rank()
    mine = torch.randn(4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))

    def setup(api):
        return None

    for src_data_rank, expected in ((None, {}), (1, {"scatter": 1, "broadcast": 1})):
        def step(api, _):
            torch.manual_seed(11 + rank)
            module = api.parallel.parallelize_module(nn.Linear(DIM, 4, dtype=torch.float64), api.mesh,
                                                     api.parallel.RowwiseParallel(), src_data_rank=src_data_rank)
            S, R = api.tensor.Shard, api.tensor.Replicate
            sharded = api.tensor.distribute_tensor(mine, api.mesh, [S(1)], src_data_rank=src_data_rank)
            replicated = api.tensor.distribute_tensor(mine, api.mesh, [R()], src_data_rank=src_data_rank)
            return [(t.to_local(), _placements(t)) for t in (module.weight, module.bias, sharded, replicated)]

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        _same(theirs, ours, f"src_data_rank={src_data_rank}")
        doubled = {kind: 2 * count for kind, count in expected.items()}  # the module's and distribute_tensor's
        _same_counts(our_counts, their_counts, doubled, f"src_data_rank={src_data_rank}")


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.register_buffer("scale", torch.linspace(1.0, 2.0, DIM))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


@spmd(meshes=[(2,)])
def test_distribute_module_hooks(mesh):
    """distribute_module with a partition_fn that shards fc1's parameters (the rest replicated, buffers
    too), an input_fn that wraps the batch-sharded plain input, and an output_fn that gathers the output
    to a plain tensor (in the older two-argument form, output_fn(outputs, mesh)). Torch's values,
    placements, gradients and collectives."""
    x = torch.randn(4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(12))

    def setup(api):
        S, R = api.tensor.Shard, api.tensor.Replicate

        def partition_fn(name, module, device_mesh):
            if name == "fc1":
                for parameter_name, parameter in list(module.named_parameters(recurse=False)):
                    sharded = api.tensor.distribute_tensor(parameter, device_mesh, [S(0)])
                    module.register_parameter(parameter_name, nn.Parameter(sharded))

        def input_fn(module, inputs, device_mesh):
            return tuple(api.tensor.DTensor.from_local(t, device_mesh, [S(0)], run_check=False).redistribute(
                device_mesh, [R()]) for t in inputs)

        def output_fn(output, device_mesh):  # PyTorch's older two-argument form
            return output.redistribute(device_mesh, [R()]).to_local()

        torch.manual_seed(13)
        model = _Scaled().to(torch.float64)
        return api.tensor.distribute_module(model, api.mesh, partition_fn, input_fn, output_fn)

    def step(api, model):
        out = model(_chunk(x, mesh, 0).clone().requires_grad_())
        out.pow(2).sum().backward()
        return out, _parameters_and_grads(model), [(name, _placements(b)) for name, b in model.named_buffers()]

    theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
    # Leaf 6, fc2's weight gradient: ours Replicate like the weight, torch's Shard(1) (fc1's output is
    # sharded along features, fc2's replicated weight multiplies it where it lies).
    _same(theirs, ours, "distribute_module", {6: (("S(1)",), ("R",))})
    # Forward: the input gathered, fc2's Partial output reduced; backward: the input's Partial gradient
    # reduce-scattered. Ours also learns the input's size (from_local without shape, run_check or not)
    # and gathers fc2's weight gradient to the weight's Replicate.
    extra = {"all_gather_into_tensor": _SIZE_AGREEMENT["all_gather_into_tensor"] + 1}
    _same_counts(_without(our_counts, extra), their_counts,
                 {"all_gather_into_tensor": 1, "all_reduce": 1, "reduce_scatter_tensor": 1}, "distribute_module")


# --- debug -----------------------------------------------------------------------------------------------


def _module_counts(api: Api, mode) -> dict:
    """{(module, phase): {c10d name: count}} of the modules that issued collectives."""
    return {(module, phase): {_c10d_name(api, kind): count for kind, count in counts.items()}
            for module, phases in mode.comm_module_counts.items() for phase, counts in phases.items() if counts}


def _json_tree(api: Api, node: dict) -> list:
    """The JSON dump's module tree: (fqn, forward collectives, backward collectives, children)."""
    def collectives(pairs):
        return sorted((_c10d_name(api, name), count) for name, count in pairs)
    return [node["fqn"], collectives(node["collectives_forward"]), collectives(node["collectives_backward"]),
            [_json_tree(api, child) for child in node["children"]]]


@spmd(meshes=[(2,)])
def test_comm_debug_mode_reports(mesh):
    """CommDebugMode over a tensor-parallel block's forward and backward: total and per-kind counts,
    per-module counts by phase, sharding and parameter info, the tracing table at noise levels 0 and 1
    and the JSON dump's module tree read like torch's. Ours keys counts by kind ("all_reduce"), torch by
    functional op (`c10d_functional.all_reduce`), and ours answers torch's keys too; the table's text is
    ours (with bytes)."""
    import json
    import os
    import tempfile

    x = torch.randn(3, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    functional = torch.ops.c10d_functional  # defined by torch.distributed._functional_collectives
    torch_ops = [functional.all_reduce, functional.all_gather_into_tensor, functional.reduce_scatter_tensor]
    reports = []
    for api in _apis(mesh):
        p = api.parallel
        model = p.parallelize_module(_stack(), api.mesh, {"layers.*.mlp.up": p.ColwiseParallel(),
                                                          "layers.*.mlp.down": p.RowwiseParallel()})
        with api.debug.CommDebugMode() as mode:
            model(x.clone().requires_grad_()).sum().backward()
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "comm.json")
            mode.generate_json_dump(path, noise_level=0)
            with open(path) as dump:
                tree = _json_tree(api, json.load(dump))
        reports.append({
            "total": mode.get_total_counts(),
            "kinds": _kinds(api, mode),
            "modules": _module_counts(api, mode),
            "sharding": {name: tuple(map(str, placements)) for name, placements in mode.get_sharding_info().items()},
            "parameters": {module: sorted(names) for module, names in mode.get_parameter_info().items()},
            "tree": tree,
            # Written for torch: counts read by torch's functional collective ops (0 for one that did not run).
            "by_torch_ops": [mode.get_comm_counts()[op] for op in torch_ops]
            + [mode.comm_module_counts["Stack.layers.0.mlp.down"]["forward"][op] for op in torch_ops],
        })
        for noise_level in (0, 1):
            table = mode.generate_comm_debug_tracing_table(noise_level=noise_level)
            assert "Global" in table and "FORWARD PASS" in table and "BACKWARD PASS" in table, table
            if api.name == "ours":  # torch prints its counts without the module names
                for module in ("Stack", "Stack.layers.0.mlp.down", "Stack.layers.1.mlp.up"):
                    assert f"\n{module}" in table.replace("  ", ""), table
    theirs, ours = reports
    for key in theirs:
        assert ours[key] == theirs[key], f"{key}: ours {ours[key]}, torch {theirs[key]}"
    assert ours["by_torch_ops"] == [4, 0, 0, 1, 0, 0], ours["by_torch_ops"]
    assert ours["kinds"] == {"all_reduce": 4}  # each block: down's output forward, up's input gradient backward


def _torch_shard_boxes(dtensor) -> set:
    """What torch's visualize_sharding tabulates (it needs `tabulate` or `rich` and `matplotlib` to print):
    per rank, the inclusive index ranges of its shard by torch's own offsets, a 1-D tensor as one column."""
    import numpy as np
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    boxes = set()
    for coordinate, rank in np.ndenumerate(np.array(dtensor.device_mesh.mesh.tolist())):
        shape, offset = _compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh.shape,
                                                               lambda i: coordinate[i], dtensor.placements)
        if all(shape):
            ranges = tuple((start, start + size - 1) for start, size in zip(offset, shape))
            boxes.add((ranges if len(ranges) == 2 else (ranges[0], (0, 0)), int(rank)))
    return boxes


def _our_shard_boxes(text: str) -> set:
    """The same, read back from our visualize_sharding's text (`Row 0-3` / `Col 4-7` / `Index 0-2` labels,
    cells `cpu:0,1`, a Partial cell prefixed `P(sum)`)."""
    import re

    lines = text.splitlines()[1:]
    header = re.split(r"\s{3,}", lines[0].strip())
    columns = [tuple(int(n) for n in label.split()[1].split("-")) for label in header]
    boxes = set()
    for line in lines[1:]:
        if not line.startswith(("Row", "Ranks")):
            continue
        label, *cells = re.split(r"\s{3,}", line.strip())
        row = tuple(int(n) for n in label.split()[1].split("-")) if label.startswith("Row") else None
        for column, cell in zip(columns, cells):
            for rank in cell.split(":")[-1].split(","):
                boxes.add(((row, column) if row else (column, (0, 0)), int(rank)))
    return boxes


@spmd(meshes=[(2,), (2, 2)])
def test_visualize_sharding_shows_torchs_shards(mesh):
    """visualize_sharding on 1-D and 2-D meshes, 1-D and 2-D tensors, even and uneven, replicated and
    Partial: every rank's index ranges in our text are the ones torch computes for its table (torch
    itself cannot print here: it needs `tabulate`, or `rich` with `matplotlib`). The text is returned on
    every rank; Partial cells are marked."""
    import torch.distributed.tensor as theirs

    placements_1d = [[shardtensor.Shard(0)], [shardtensor.Replicate()], [shardtensor.Shard(1)]]
    placements_2d = [[shardtensor.Shard(0), shardtensor.Shard(1)], [shardtensor.Shard(1), shardtensor.Shard(0)],
                     [shardtensor.Replicate(), shardtensor.Shard(0)], [shardtensor.Shard(0), shardtensor.Shard(0)],
                     [shardtensor.Partial(), shardtensor.Shard(1)]]
    for shape in ((8, 6), (5, 3), (7,)):
        for placements in placements_1d if mesh.ndim == 1 else placements_2d:
            if len(shape) == 1 and any(getattr(p, "dim", 0) == 1 for p in placements):
                continue
            full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
            if any(isinstance(p, shardtensor.Partial) for p in placements):
                replicated = [shardtensor.Replicate() if isinstance(p, shardtensor.Partial) else p for p in placements]
                local = local_piece(full, mesh.shape, replicated, mesh.get_coordinate())
                ours = shardtensor.DTensor.from_local(local, mesh, placements, shape=full.shape)
                torch_placements = [theirs.Replicate() if isinstance(p, shardtensor.Partial) else theirs.Shard(p.dim)
                                    for p in placements]
            else:
                ours = shardtensor.distribute_tensor(full, mesh, placements)
                torch_placements = [theirs.Shard(p.dim) if isinstance(p, shardtensor.Shard) else theirs.Replicate()
                                    for p in placements]
            torch_tensor = theirs.distribute_tensor(full, torch_mesh(mesh), torch_placements)
            text = shardtensor.debug.visualize_sharding(ours)
            what = f"shape {shape} placements {placements}:\n{text}"
            assert _our_shard_boxes(text) == _torch_shard_boxes(torch_tensor), what
            assert ("P(sum) cpu:" in text) == any(isinstance(p, shardtensor.Partial) for p in placements), what



@spmd(meshes=[(2, 2)])
def test_explain_redistribute_matches_what_runs(mesh):
    """explain_redistribute (ours only) prints the plan a redistribute then runs: its collectives are the
    ones CommDebugMode counts, the value is torch's, and the plan issues no more collectives than torch's
    redistribute of the same tensor (fewer where torch moves one mesh dim at a time)."""
    import io

    import torch.distributed.tensor as theirs

    full = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(16))
    S, R = shardtensor.Shard, shardtensor.Replicate
    cases = [([S(0), S(1)], [S(1), S(0)]), ([S(0), S(0)], [R(), S(0)]), ([S(0), R()], [R(), S(1)]),
             ([R(), R()], [S(1), S(0)]), ([S(1), S(0)], [R(), R()])]

    def torch_placements(placements):
        return [theirs.Shard(p.dim) if isinstance(p, S) else theirs.Replicate() for p in placements]

    for source, target in cases:
        what = f"{source} -> {target}"
        ours = shardtensor.distribute_tensor(full, mesh, source)
        printed = io.StringIO()
        plan = shardtensor.debug.explain_redistribute(ours, target, file=printed)
        assert all(str(step) in printed.getvalue() for step in plan.steps), f"{what}:\n{printed.getvalue()}\n{plan}"
        assert "lower bound" in printed.getvalue(), printed.getvalue()
        with shardtensor.debug.CommDebugMode() as mode:
            moved = ours.redistribute(mesh, target)
        ran = [kind for kind, count in sorted(mode.get_comm_counts().items()) for _ in range(count)]
        assert ran == sorted(plan.collectives), f"{what}: ran {ran}, planned {plan.collectives}"
        torch_source = theirs.distribute_tensor(full, torch_mesh(mesh), torch_placements(source))
        torch_moved, torch_count = torch_collectives(
            lambda: torch_source.redistribute(torch_mesh(mesh), torch_placements(target)))
        assert len(plan.collectives) <= torch_count, f"{what}: ours {plan.collectives}, torch {torch_count}"
        _same(torch_moved, moved, what)


# --- experimental ----------------------------------------------------------------------------------------


@spmd(meshes=[(2,)])
def test_local_map_programs(mesh):
    """local_map as torch documents it: a local matmul on Shard(1) x Shard(0) giving a Partial output
    (device_mesh given), inputs redistributed to in_placements (redistribute_inputs), a replicated
    weight whose local gradients differ per rank read as Partial (in_grad_placements), and several outputs
    with a None for a non-tensor one: torch's values, placements, gradients and collectives."""
    generator = torch.Generator().manual_seed(17)
    w_full, x_full = torch.randn(4, 6, dtype=torch.float64, generator=generator), torch.randn(6, 3, dtype=torch.float64, generator=generator)

    def setup(api):
        S, R = api.tensor.Shard, api.tensor.Replicate
        w = api.tensor.distribute_tensor(w_full, api.mesh, [S(1)]).requires_grad_()
        x = api.tensor.distribute_tensor(x_full, api.mesh, [R()]).requires_grad_()
        return w, x

    def step(api, state):
        w, x = state
        S, R, P = api.tensor.Shard, api.tensor.Replicate, api.tensor.Partial
        local_mm = api.experimental.local_map(torch.mm, out_placements=[P()], in_placements=([S(1)], [S(0)]),
                                              device_mesh=api.mesh, redistribute_inputs=True)
        product = local_mm(w, x)  # x moves from Replicate to Shard(0)

        def scale_rows(x_local, weight_local, factor):
            scaled = x_local * weight_local[: x_local.shape[0], :1]
            return scaled, scaled.sum(), factor * 2

        rows = api.experimental.local_map(
            scale_rows, out_placements=([S(0)], [P()], None), in_placements=([S(0)], [R()], None),
            in_grad_placements=([S(0)], [P()], None), device_mesh=api.mesh, redistribute_inputs=True)
        weight = api.tensor.distribute_tensor(torch.ones(6, 3, dtype=torch.float64) * 0.5, api.mesh, [R()]).requires_grad_()
        scaled, total, doubled = rows(x, weight, 3)
        loss = product.redistribute(api.mesh, [R()]).pow(2).sum() + scaled.pow(2).sum() + total
        loss.backward()
        return product, scaled, total, doubled, w.grad, x.grad, weight.grad

    theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
    _same(theirs, ours, "local_map", {6: (("P(sum)",), ("R",))})
    # Forward: the weight broadcast (distribute_tensor), the Partial product reduced; backward: x's two
    # Shard(0) gradients gathered to its Replicate. The weight's gradient is Partial, as in_grad_placements
    # says: torch keeps it so, ours reduces it when backward ends (one all_reduce, leaf 6 Replicate like the
    # weight). Ours also learns the Shard(0) output's exact sizes (out_shard_sizes="infer").
    _same_counts(_without(our_counts, {**_SIZE_AGREEMENT, "all_reduce": 1}), their_counts,
                 {"broadcast": 1, "all_reduce": 1, "all_gather_into_tensor": 2}, "local_map")


@torch.library.custom_op("api_journeys::row_scale", mutates_args=())
def _row_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w.unsqueeze(-1)


@torch.library.custom_op("api_journeys::row_dot", mutates_args=())
def _row_dot(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (g * x).sum(-1)


_row_scale.register_fake(lambda x, w: torch.empty_like(x))
_row_dot.register_fake(lambda g, x: g.new_empty(g.shape[:-1]))
_row_scale.register_autograd(
    lambda ctx, grad: (_row_scale(grad, ctx.saved_tensors[1]), _row_dot(grad, ctx.saved_tensors[0])),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def _register_row_rules(api: Api) -> None:
    """The same user rules, registered with either library: row_scale (used in forward and backward)
    shards rows with its row weights, or columns with the weights replicated; row_dot (backward) shards
    rows, or contracts sharded columns into a Partial sum."""
    S, R, P = api.tensor.Shard, api.tensor.Replicate, api.tensor.Partial

    @api.experimental.register_sharding(torch.ops.api_journeys.row_scale.default)
    def row_scale_strategies(x, w):
        return [([R()], [R(), R()]), ([S(0)], [S(0), S(0)]), ([S(1)], [S(1), R()])]

    @api.experimental.register_sharding(torch.ops.api_journeys.row_dot.default)
    def row_dot_strategies(g, x):
        return [([R()], [R(), R()]), ([S(0)], [S(0), S(0)]), ([P()], [S(1), S(1)])]


@spmd(meshes=[(2,)])
def test_register_sharding_rules_in_forward_and_backward(mesh):
    """register_sharding for two custom ops, the forward one also called by its own backward: with rows
    or columns sharded, torch's values, output placements, gradients and collectives (none: the rules
    keep every op local)."""
    generator = torch.Generator().manual_seed(18)
    x_full, w_full = torch.randn(4, 6, dtype=torch.float64, generator=generator), torch.randn(4, dtype=torch.float64, generator=generator)
    for x_dim, w_placement in ((0, "S(0)"), (1, "R")):
        def setup(api):
            _register_row_rules(api)
            S, R = api.tensor.Shard, api.tensor.Replicate
            x = api.tensor.distribute_tensor(x_full, api.mesh, [S(x_dim)]).requires_grad_()
            w = api.tensor.distribute_tensor(w_full, api.mesh, [S(0) if w_placement == "S(0)" else R()]).requires_grad_()
            return x, w

        def step(api, state):
            x, w = state
            out = torch.ops.api_journeys.row_scale(x, w)
            out.backward(out.detach() * 2)
            return out, x.grad, w.grad

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        # Sharded columns: the row weights' gradient (leaf 2) is a Partial sum; ours reduces it to the
        # weights' Replicate when backward ends (one all_reduce), torch keeps it Partial.
        reduced = {2: (("P(sum)",), ("R",))} if x_dim == 1 else {}
        _same(theirs, ours, f"x Shard({x_dim})", reduced)
        _same_counts(_without(our_counts, {"all_reduce": len(reduced)}), their_counts, {}, f"x Shard({x_dim})")


@spmd(meshes=[(2,), (2, 2)])
def test_implicit_replication(mesh):
    """implicit_replication: plain tensors mixed with DTensors (a bias, a scale, a mask) read as
    replicated, along sharded dims too: torch's values, placements and gradients (of the DTensor and of a
    plain tensor that requires grad: a DTensor in both libraries, with one device's value), and no
    collectives."""
    generator = torch.Generator().manual_seed(19)
    full = torch.randn(4, 6, dtype=torch.float64, generator=generator)
    bias, scale = torch.randn(6, dtype=torch.float64, generator=generator), torch.randn(4, 1, dtype=torch.float64, generator=generator)
    for placements in ([0] * mesh.ndim, [1] * mesh.ndim, [0, 1][: mesh.ndim]):
        def setup(api):
            x = api.tensor.distribute_tensor(full, api.mesh, [api.tensor.Shard(dim) for dim in placements])
            return x.requires_grad_(), bias.clone().requires_grad_()

        def step(api, state):
            x, plain_bias = state
            with api.experimental.implicit_replication():
                out = (x + plain_bias) * scale
                out = torch.where(out > 0, out, torch.zeros(()))
                out.sum().backward()
            return out, x.grad, plain_bias.grad

        theirs, ours, their_counts, our_counts = _both(mesh, setup, step)
        _same(theirs, ours, f"Shard dims {placements}")
        _same_counts(our_counts, their_counts, {}, f"Shard dims {placements}")
        plain_bias = bias.clone().requires_grad_()
        single = (full + plain_bias) * scale
        torch.where(single > 0, single, torch.zeros(())).sum().backward()
        # The plain bias's gradient is a DTensor (Partial or sharded) in both libraries; its value is one device's.
        assert_close(_value(ours[2]), plain_bias.grad, rtol=1e-12, atol=1e-12)
