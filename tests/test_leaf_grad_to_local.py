"""Leaves used through `to_local(grad_placements=...)` keep their placements after backward (gradients.py),
and `from_local` / `to_local` round trips give the single-device gradients.

Each program runs twice on the same gloo ranks, with torch.distributed.tensor (the oracle of values and
collective counts) and with shardtensor, forward and backward counted separately. Where our backward
issues one all_reduce that torch's does not, it is the reduction of a Partial gradient of a Replicate
leaf: ours reduces it when backward ends (bucketed with the other leaves' gradients), so `.grad` is laid
out like its leaf; torch keeps `.grad` Partial(sum) and leaves the reduction to whoever reads it.
"""

import typing

import torch
from helpers import collective_kinds, exact_full, local_piece, partial_and_value, torch_mesh
from spmd import spmd
from torch.testing import assert_close

import shardtensor
import shardtensor.debug
import shardtensor.experimental
from shardtensor import comm


class Library(typing.NamedTuple):
    """One library's names as a program uses them, and the mesh it runs on."""

    name: str
    tensor: typing.Any  # torch.distributed.tensor or shardtensor
    local_map: typing.Callable
    CommDebugMode: type
    mesh: typing.Any


def _libraries(mesh) -> tuple[Library, Library]:
    import torch.distributed.tensor as theirs
    from torch.distributed.tensor.debug import CommDebugMode as TheirCommDebugMode
    from torch.distributed.tensor.experimental import local_map as their_local_map

    return (
        Library("torch", theirs, their_local_map, TheirCommDebugMode, torch_mesh(mesh)),
        Library("ours", shardtensor, shardtensor.experimental.local_map, shardtensor.debug.CommDebugMode, mesh),
    )


def _run(library: Library, program) -> tuple:
    """`program(library)` returns (forward, backward) callables; run each under the library's
    CommDebugMode. Returns (backward's result, forward's collectives, backward's, our backward records)."""
    forward, backward = program(library)
    with library.CommDebugMode() as forward_mode:
        loss = forward()
    with library.CommDebugMode() as backward_mode:
        loss.backward()
        result = backward()
    records = list(backward_mode.records) if library.name == "ours" else None
    return result, collective_kinds(forward_mode), collective_kinds(backward_mode), records


def _rows_of_rank(full: torch.Tensor, mesh, rank: int | None = None) -> torch.Tensor:
    """The rows of `full` that `rank` (default: this one) holds when they are split over every rank of the
    mesh in rank order."""
    return full.chunk(mesh.size())[mesh.get_rank() if rank is None else rank]


def _all_reduce_record(mesh_dim, group_size: int, numel: int) -> comm.CommRecord:
    """The record of one ring all_reduce of `numel` float64 values."""
    traffic = 2 * (group_size - 1) * 8 * numel // group_size
    return comm.CommRecord("all_reduce", mesh_dim, group_size, traffic, traffic)


def _one_per_mesh_dim(counts: dict, mesh) -> dict:
    """`counts` of a 1-D mesh as a library issues them when it moves one mesh dim at a time."""
    return {kind: count * mesh.ndim for kind, count in counts.items()}


def _every_mesh_dim(mesh):
    return tuple(range(mesh.ndim)) if mesh.ndim > 1 else 0


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_replicate_leaf_read_as_partial_through_to_local_is_reduced_with_the_others(mesh):
    """A Replicate weight W used only through `W.to_local(grad_placements=[Partial()])`, twice (each rank
    multiplies its rows of a batch), and a Replicate weight V used through a DTensor matmul with a
    batch-sharded input: both `.grad` are Replicate with the single-device values, reduced in one
    all_reduce when backward ends (not one per use, not one per leaf). Torch: forward and backward issue
    nothing, and both `.grad` stay Partial(sum) with the same sum."""
    batch, w_full, v_full = exact_full((2 * mesh.size(), 4), 1), exact_full((4, 3), 2), exact_full((4, 2), 3)

    def program(lib):
        replicate, partial = _placements(lib, "R", mesh.ndim), _placements(lib, "P", mesh.ndim)
        W = lib.tensor.distribute_tensor(w_full, lib.mesh, replicate).requires_grad_()
        V = lib.tensor.distribute_tensor(v_full, lib.mesh, replicate).requires_grad_()
        batch_dt = lib.tensor.distribute_tensor(batch, lib.mesh, _placements(lib, "S0", mesh.ndim))
        rows = _rows_of_rank(batch, mesh)

        def forward():
            first = rows @ W.to_local(grad_placements=partial)
            second = (rows * 0.5) @ W.to_local(grad_placements=partial)
            sharded_loss = (batch_dt @ V).pow(2).sum()  # Partial(sum): each rank's rows' share
            return first.pow(2).sum() + second.sum() + sharded_loss.to_local(grad_placements=replicate)

        return forward, lambda: (W.grad, V.grad)

    references = [w_full.clone().requires_grad_(), v_full.clone().requires_grad_()]
    ((batch @ references[0]).pow(2).sum() + (batch * 0.5 @ references[0]).sum()
     + (batch @ references[1]).pow(2).sum()).backward()
    (their_w, their_v), their_forward, their_backward, _ = _run(_libraries(mesh)[0], program)
    (our_w, our_v), our_forward, our_backward, records = _run(_libraries(mesh)[1], program)
    for theirs, ours, reference in ((their_w, our_w, references[0]), (their_v, our_v, references[1])):
        assert ours.placements == (shardtensor.Replicate(),) * mesh.ndim, ours.placements
        assert_close(ours.to_local(), reference.grad, rtol=0, atol=0)
        assert all(placement.is_partial() for placement in theirs.placements), theirs.placements
        assert_close(theirs.full_tensor(), reference.grad, rtol=0, atol=0)
    assert our_forward == their_forward == {}, (our_forward, their_forward)
    assert their_backward == {} and our_backward == {"all_reduce": 1}, (their_backward, our_backward)
    assert records == [_all_reduce_record(_every_mesh_dim(mesh), mesh.size(), w_full.numel() + v_full.numel())]


@spmd(meshes=[(2,), (2, 2)])
def test_to_local_gradients_accumulate_over_two_backward_passes(mesh):
    """Two backward passes without zeroing, a Replicate weight read as Partial through `to_local` in each:
    the Replicate `.grad` goes back to a Partial operand locally, takes the second gradient, and is reduced
    once more when that backward ends: `.grad` is the single-device sum of both, one all_reduce per
    backward. Torch: none, and `.grad` stays Partial(sum)."""
    batch, w_full = exact_full((2 * mesh.size(), 4), 10), exact_full((4, 3), 11)
    reference = w_full.clone().requires_grad_()
    for scale in (1.0, 0.5):
        (batch * scale @ reference).pow(2).sum().backward()
    for lib in _libraries(mesh):
        W = lib.tensor.distribute_tensor(w_full, lib.mesh, _placements(lib, "R", mesh.ndim)).requires_grad_()
        counts = []
        for scale in (1.0, 0.5):
            product = _rows_of_rank(batch, mesh) * scale @ W.to_local(grad_placements=_placements(lib, "P", mesh.ndim))
            with lib.CommDebugMode() as backward:
                product.pow(2).sum().backward()
            counts.append(collective_kinds(backward))
        if lib.name == "ours":
            assert W.grad.placements == (shardtensor.Replicate(),) * mesh.ndim, W.grad.placements
            assert_close(W.grad.to_local(), reference.grad, rtol=0, atol=0)
            assert counts == [{"all_reduce": 1}] * 2, counts
        else:
            assert all(placement.is_partial() for placement in W.grad.placements), W.grad.placements
            assert_close(W.grad.full_tensor(), reference.grad, rtol=0, atol=0)
            assert counts == [{}] * 2, counts


@spmd(meshes=[(2, 2)])
def test_replicate_shard_leaf_read_as_partial_shard_through_to_local(mesh):
    """A [Replicate(), Shard(0)] weight read with `grad_placements=[Partial(), Shard(0)]` (each row of
    ranks multiplies its rows by its own data): `.grad` is [Replicate(), Shard(0)] with the single-device
    rows, from one all_reduce over mesh dim 0 of the local shard. Torch: nothing issued, `.grad` stays
    [Partial(sum), Shard(0)]."""
    w_full, data = exact_full((4, 3), 4), exact_full((mesh.size(0), 4, 3), 5)
    coordinate, layout = mesh.get_coordinate(), (shardtensor.Replicate(), shardtensor.Shard(0))
    mine = local_piece(data[coordinate[0]], mesh.shape, layout, coordinate)

    def program(lib):
        W = lib.tensor.distribute_tensor(w_full, lib.mesh, [lib.tensor.Replicate(), lib.tensor.Shard(0)]).requires_grad_()

        def forward():
            local = W.to_local(grad_placements=[lib.tensor.Partial(), lib.tensor.Shard(0)])
            return (local * mine).pow(2).sum()

        return forward, lambda: W.grad

    reference = w_full.clone().requires_grad_()
    sum((reference * data[row]).pow(2).sum() for row in range(mesh.size(0))).backward()
    theirs, their_forward, their_backward, _ = _run(_libraries(mesh)[0], program)
    ours, our_forward, our_backward, records = _run(_libraries(mesh)[1], program)
    assert ours.placements == layout, ours.placements
    assert_close(ours.to_local(), local_piece(reference.grad, mesh.shape, layout, coordinate), rtol=0, atol=0)
    assert [str(placement) for placement in theirs.placements] == ["P(sum)", "S(0)"], theirs.placements
    assert_close(theirs.full_tensor(), reference.grad, rtol=0, atol=0)
    assert our_forward == their_forward == {} and their_backward == {}, (our_forward, their_forward, their_backward)
    assert our_backward == {"all_reduce": 1}, our_backward
    assert records == [_all_reduce_record(0, mesh.size(0), w_full.numel() // mesh.size(1))]


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_local_map_weight_read_as_partial_keeps_its_placements(mesh):
    """local_map with a Replicate weight read with `in_grad_placements=[Partial()]` and batch-sharded
    rows, called twice on the same weight, outputs Partial and summed, then made whole: the rows' and
    the weight's `.grad` are laid out like them, with the single-device values. Forward: the all_reduce
    of the loss (torch: one per mesh dim; ours: one over every mesh dim); backward: ours reduces the
    weight's gradient once, torch leaves it Partial(sum)."""
    batch, w_full = exact_full((2 * mesh.size(), 4), 6), exact_full((4, 3), 7)

    def program(lib):
        rows, replicate = _placements(lib, "S0", mesh.ndim), _placements(lib, "R", mesh.ndim)
        partial = _placements(lib, "P", mesh.ndim)
        X = lib.tensor.distribute_tensor(batch, lib.mesh, rows).requires_grad_()
        W = lib.tensor.distribute_tensor(w_full, lib.mesh, replicate).requires_grad_()
        squares = lib.local_map(lambda x, w: (x @ w).pow(2).sum(), out_placements=partial,
                                in_placements=(rows, replicate), in_grad_placements=(rows, partial))
        halves = lib.local_map(lambda x, w: (x * 0.5 @ w).sum(), out_placements=partial,
                               in_placements=(rows, replicate), in_grad_placements=(rows, partial))
        return lambda: (squares(X, W) + halves(X, W)).full_tensor(), lambda: (X.grad, W.grad)

    references = [batch.clone().requires_grad_(), w_full.clone().requires_grad_()]
    ((references[0] @ references[1]).pow(2).sum() + (references[0] * 0.5 @ references[1]).sum()).backward()
    theirs, their_forward, their_backward, _ = _run(_libraries(mesh)[0], program)
    ours, our_forward, our_backward, records = _run(_libraries(mesh)[1], program)
    assert [grad.placements for grad in ours] == [(shardtensor.Shard(0),) * mesh.ndim,
                                                   (shardtensor.Replicate(),) * mesh.ndim], ours
    assert_close(ours[0].to_local(), _rows_of_rank(references[0].grad, mesh), rtol=0, atol=0)
    assert_close(ours[1].to_local(), references[1].grad, rtol=0, atol=0)
    assert all(placement.is_partial() for placement in theirs[1].placements), theirs[1].placements
    for their, reference in zip(theirs, references):
        assert_close(their.full_tensor(), reference.grad, rtol=0, atol=0)
    assert our_forward == {"all_reduce": 1} and their_forward == {"all_reduce": mesh.ndim}, (our_forward, their_forward)
    assert their_backward == {} and our_backward == {"all_reduce": 1}, (their_backward, our_backward)
    assert records == [_all_reduce_record(_every_mesh_dim(mesh), mesh.size(), w_full.numel())]


# (from_local placements, to_local grad_placements, local use, collectives of forward and of backward on
# a 1-D mesh), placements by name, the same on every mesh dim ("R", "S0", "P"). Both libraries issue them.
# On a 2-D mesh torch gathers and reduces one mesh dim at a time (twice the count), where ours gathers
# nested shards of one tensor dim over both mesh dims at once (the same bytes in one collective) and
# reduces a Partial on both mesh dims at once (one collective over the 4 ranks: a ring all_reduce moves
# 2*3/4 of the bytes per rank, torch's two 2*(2*1/2) = 2 times them).
_ROUND_TRIPS = [
    # A replicated activation fed to each rank's share of a computation (Megatron's "f"): the plain
    # leaf's gradient is the sum of the ranks' local gradients, one all_reduce in backward.
    ("R", "P", "local", {}, {"all_reduce": 1}),
    # Sequence-parallel: rows gathered for the local computation (all_gather), the gradient of the
    # gathered rows a partial sum, scattered back as each rank's rows (reduce_scatter).
    ("S0", "P", "gathered", {"all_gather": 1}, {"reduce_scatter": 1}),
    # Rows kept where they are: nothing moves either way.
    ("S0", "S0", "local", {}, {}),
]


def _placements(library, names: str, ndim: int) -> list:
    """`ndim` placements named `names` ("R", "S0", "P") from `library` (a Library, or shardtensor)."""
    tensor = getattr(library, "tensor", library)
    make = {"R": tensor.Replicate, "S0": lambda: tensor.Shard(0), "P": tensor.Partial}
    return [make[names]() for _ in range(ndim)]


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_from_local_to_local_round_trips_of_plain_leaves(mesh):
    """A plain leaf made a DTensor by `from_local` (with `shape`, so no size agreement) and read back by
    `to_local(grad_placements=...)` (after gathering its rows, for the sequence-parallel entry), each rank
    then multiplying with its own data: the plain leaf's gradient is the single-device gradient of its
    piece, and both libraries issue the collectives of `_ROUND_TRIPS` (on a 2-D mesh torch one per mesh dim)."""
    full, data = exact_full((2 * mesh.size(), 3), 8), exact_full((mesh.size(), 2 * mesh.size(), 3), 9)
    for placements_name, grad_name, use, forward_expected, backward_expected in _ROUND_TRIPS:
        def program(lib):
            placements, grad_placements = _placements(lib, placements_name, mesh.ndim), _placements(lib, grad_name, mesh.ndim)
            ours = _placements(shardtensor, placements_name, mesh.ndim)
            leaf = local_piece(full, mesh.shape, ours, mesh.get_coordinate()).clone().requires_grad_()
            mine = local_piece(data[mesh.get_rank()], mesh.shape, _placements(shardtensor, grad_name, mesh.ndim),
                               mesh.get_coordinate())

            def forward():
                dtensor = lib.tensor.DTensor.from_local(leaf, lib.mesh, placements, shape=full.shape, stride=full.stride())
                if use == "gathered":
                    dtensor = dtensor.redistribute(lib.mesh, _placements(lib, "R", mesh.ndim))
                local = dtensor.to_local(grad_placements=grad_placements)
                return (local * mine).pow(2).sum()

            return forward, lambda: leaf.grad

        reference = full.clone().requires_grad_()
        if grad_name == "P":  # every rank's computation reads the whole tensor
            sum((reference * data[rank]).pow(2).sum() for rank in range(mesh.size())).backward()
        else:  # each rank's rows times the same rows of its own data
            sum((_rows_of_rank(reference, mesh, rank) * _rows_of_rank(data[rank], mesh, rank)).pow(2).sum()
                for rank in range(mesh.size())).backward()
        results = [_run(library, program) for library in _libraries(mesh)]
        expected_counts = {
            "torch": (_one_per_mesh_dim(forward_expected, mesh), _one_per_mesh_dim(backward_expected, mesh)),
            "ours": (forward_expected, backward_expected),
        }
        expected = reference.grad
        if placements_name != "R":
            expected = _rows_of_rank(expected, mesh)
        for name, (grad, forward, backward, _) in zip(("torch", "ours"), results):
            where = f"{placements_name} -> {grad_name} ({use}), {name}"
            assert type(grad) is torch.Tensor, where
            assert_close(grad, expected, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
            assert (forward, backward) == expected_counts[name], (where, forward, backward, expected_counts[name])



# How a leaf is used before the loss, where no torch function sees it (the whole tensor on every rank):
# use -> the placements it is redistributed to first ("R", "S0"), None for `full_tensor()` alone.
_WHOLE_TENSOR_USES = {"redistribute(R).to_local()": "R", "full_tensor()": None, "redistribute(S0).full_tensor()": "S0"}


def _whole_tensor(leaf, lib, through: str | None) -> torch.Tensor:
    if through is None:
        return leaf.full_tensor()
    moved = leaf.redistribute(lib.mesh, _placements(lib, through, lib.mesh.ndim))
    return moved.to_local() if through == "R" else moved.full_tensor()


@spmd(meshes=[(2,), (2, 2)])
def test_leaves_used_only_through_redistribute_keep_their_placements(mesh):
    """A Partial(sum), Partial(max) or Shard(1) leaf used only through `redistribute` / `full_tensor`:
    its `.grad` has the leaf's placements and the single-device gradient (with respect to the leaf's
    value: a Partial `.grad`'s operands combine to it). Backward issues what the redistributions' own
    backward issues, as torch's does (the gathering of a Shard(0) gradient, one all_gather per mesh dim),
    and nothing more: a Partial leaf's Replicate gradient becomes its operands locally when backward
    ends. Torch: a Partial leaf's `.grad` stays Replicate."""
    weight = exact_full((6, 4), 12)
    cases = [(leaf, use) for leaf in ("P(sum)", "P(max)") for use in _WHOLE_TENSOR_USES]
    cases += [("S(1)", "redistribute(R).to_local()"), ("S(1)", "full_tensor()")]
    for leaf_name, use_name in cases:
        if leaf_name.startswith("P"):
            ours, value = partial_and_value(mesh, (6, 4), leaf_name[2:-1])
            operand, placements = ours.to_local(), ours.placements
        else:
            value, placements = exact_full((6, 4), 13), (shardtensor.Shard(1),) * mesh.ndim
            operand = local_piece(value, mesh.shape, placements, mesh.get_coordinate())
        reference = value.clone().requires_grad_()
        (reference * weight).pow(2).sum().backward()
        through = _WHOLE_TENSOR_USES[use_name]

        def program(lib):
            their_placements = [_their_placement(lib, placement) for placement in placements]
            leaf = lib.tensor.DTensor.from_local(operand.clone(), lib.mesh, their_placements, shape=value.shape,
                                                 stride=value.stride()).requires_grad_()
            return lambda: (_whole_tensor(leaf, lib, through) * weight).pow(2).sum(), lambda: leaf.grad

        theirs, _, their_backward, _ = _run(_libraries(mesh)[0], program)
        grad, _, our_backward, _ = _run(_libraries(mesh)[1], program)
        where = f"{leaf_name} leaf, {use_name}"
        assert grad.placements == placements, (where, grad.placements)
        assert_close(grad.full_tensor(), reference.grad, msg=lambda text: f"{where}: {text}")
        expected = {"all_gather": mesh.ndim} if use_name.startswith("redistribute(S0)") else {}
        assert our_backward == their_backward == expected, (where, our_backward, their_backward)
        their_kinds = [placement.is_shard(1) if leaf_name == "S(1)" else placement.is_replicate()
                       for placement in theirs.placements]
        assert all(their_kinds), (where, theirs.placements)
        assert_close(theirs.full_tensor(), reference.grad, msg=lambda text: f"{where}, torch: {text}")


def _their_placement(library, placement):
    """`placement` (ours) in `library`'s names."""
    if placement.is_partial():
        return library.tensor.Partial(placement.reduce_op)
    return library.tensor.Shard(placement.dim) if placement.is_shard() else library.tensor.Replicate()
