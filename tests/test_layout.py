"""Layout arithmetic against torch.chunk and explicit slicing, without processes."""

import itertools

import pytest
import torch

from shardtensor.layout import Layout, chunk_sizes
from shardtensor.placement import Partial, Replicate, Shard


@pytest.mark.parametrize("size", range(0, 10))
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_chunk_sizes_follow_torch_chunk(size, parts):
    expected = [len(chunk) for chunk in torch.arange(size).chunk(parts)] if size else []
    expected += [0] * (parts - len(expected))
    assert chunk_sizes(size, parts) == tuple(expected)


def _slices_by_hand(layout, coordinate, tensor):
    """The local shard by applying torch.chunk per mesh dim in shard order, as a reference."""
    local = tensor
    offsets = [0] * tensor.ndim
    for dim, mesh_dims in enumerate(layout.shard_order):
        for mesh_dim in mesh_dims:
            chunks = list(local.tensor_split(
                list(itertools.accumulate(chunk_sizes(local.shape[dim], layout.mesh_shape[mesh_dim])))[:-1], dim))
            before = sum(c.shape[dim] for c in chunks[: coordinate[mesh_dim]])
            offsets[dim] += before
            local = chunks[coordinate[mesh_dim]]
    return local, tuple(offsets)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 3), (3, 2, 2)])
@pytest.mark.parametrize("shape", [(5, 7), (1, 4), (0, 3), (8, 9)])
def test_local_shapes_and_offsets_match_nested_chunking(mesh_shape, shape):
    tensor = torch.arange(shape[0] * shape[1]).reshape(shape)
    choices = [Shard(0), Shard(1), Replicate(), Partial()]
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        layout = Layout.create(mesh_shape, placements, shape)
        assert layout.is_chunked()
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            expected, offset = _slices_by_hand(layout, coordinate, tensor)
            assert layout.local_shape(coordinate) == tuple(expected.shape)
            assert layout.local_offset(coordinate) == offset


def test_explicit_shard_sizes_are_exact():
    layout = Layout.create((2, 2), [Shard(0), Shard(1)], (5, 6), shard_sizes={0: [4, 1], 1: [0, 6]})
    assert layout.local_shape((0, 0)) == (4, 0)
    assert layout.local_shape((1, 1)) == (1, 6)
    assert layout.local_offset((1, 1)) == (4, 0)
    assert not layout.is_chunked()
    assert layout.sizes_along(0, 0, (0, 1)) == [4, 1]


@pytest.mark.parametrize(
    "shard_sizes, message",
    [
        ({0: [3, 1]}, "summing to the size 5"),
        ({0: [5]}, "must have 2"),
        ({1: [2, 3]}, "only meaningful for Shard"),
        ({2: [2, 3]}, "not a mesh dim"),
        ("ragged", "not understood"),
    ],
)
def test_bad_shard_sizes_name_the_problem(shard_sizes, message):
    with pytest.raises(ValueError, match=message):
        Layout.create((2, 2), [Shard(0), Replicate()], (5, 6), shard_sizes=shard_sizes)


def test_nested_explicit_sizes_point_to_infer():
    with pytest.raises(ValueError, match="infer"):
        Layout.create((2, 2), [Shard(0), Shard(0)], (5, 6), shard_sizes={0: [4, 1]})


def test_from_local_shapes_builds_nested_ragged_pieces():
    shapes = {(0, 0): (3, 2), (0, 1): (1, 2), (1, 0): (0, 2), (1, 1): (2, 2)}
    layout = Layout.from_local_shapes((2, 2), [Shard(0), Shard(0)], shapes)
    assert layout.shape == (6, 2)
    assert layout.pieces[0] == (3, 1, 0, 2)
    assert layout.local_offset((1, 1)) == (4, 0)


def test_from_local_shapes_rejects_disagreeing_replicas():
    shapes = {(0,): (3, 2), (1,): (3, 1)}
    with pytest.raises(ValueError, match="disagree on tensor dim 1"):
        Layout.from_local_shapes((2,), [Shard(0)], shapes)


def test_shard_order_controls_nesting():
    default = Layout.create((2, 3), [Shard(0), Shard(0)], (12,))
    swapped = Layout.create((2, 3), [Shard(0), Shard(0)], (12,), shard_order=[(1, 0)])
    assert default.local_offset((1, 0)) == (6,)
    assert swapped.local_offset((1, 0)) == (2,)
    assert not swapped.has_default_shard_order()
    with pytest.raises(ValueError, match="shard_order"):
        Layout.create((2, 3), [Shard(0), Shard(0)], (12,), shard_order=[(0,)])


def test_transition_moves_only_innermost_shards():
    layout = Layout.create((2, 2), [Shard(0), Shard(0)], (8, 4))
    gathered_inner = layout.transition(1, Replicate())
    assert gathered_inner == Layout.create((2, 2), [Shard(0), Replicate()], (8, 4))
    with pytest.raises(ValueError, match="innermost"):
        layout.transition(0, Replicate())
    moved = layout.transition(1, Shard(1))
    assert moved == Layout.create((2, 2), [Shard(0), Shard(1)], (8, 4))
    resharded = Layout.create((2, 2), [Replicate(), Shard(0)], (8, 4)).transition(0, Shard(0))
    assert resharded.shard_order == ((1, 0), ())


def test_with_placements_keeps_pieces_of_unchanged_dims():
    layout = Layout.create((2, 2), [Shard(0), Replicate()], (5, 6), shard_sizes={0: [4, 1]})
    target = layout.with_placements([Shard(0), Shard(1)])
    assert target.pieces == ((4, 1), (3, 3))
    assert layout.with_placements([Replicate(), Replicate()]).pieces == ((5,), (6,))


def test_layouts_are_hashable_values():
    a = Layout.create((2,), [Shard(-1)], (3, 4))
    b = Layout.create((2,), [Shard(1)], (3, 4))
    assert a == b and hash(a) == hash(b)
    assert str(a) == "[S(1)] shape=(3, 4) mesh=(2,)"


def test_layout_hash_is_cached_and_survives_copies():
    """The hash is computed once; pickling rebuilds it (string hashes differ between processes)."""
    import copy
    import dataclasses
    import pickle

    layout = Layout.create((2, 2), [Shard(0), Partial()], (5, 4))
    assert layout._hash == hash(layout)
    for other in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout), dataclasses.replace(layout)):
        assert other == layout and hash(other) == hash(layout)
    moved = dataclasses.replace(layout, pieces=((3, 2), (4,)))
    assert hash(moved) == hash((moved.mesh_shape, moved.placements, moved.shape, moved.shard_order, moved.pieces))
    assert "_hash" not in repr(layout)


def _symbolic_size(value: int):
    """A SymInt standing for `value`, as torch.compile's dynamic shapes make them (a fresh ShapeEnv)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    return env.create_symintnode(env.create_symbol(value, ConstantSource("size")), hint=value)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_symbolic_chunk_sizes_follow_torch_chunk_without_guards(parts):
    """Dynamic shapes on a sharded dim: the pieces are SymInt expressions whose values are torch.chunk's and
    whose sum is the size itself as an expression (so comparing them adds no guard to the graph)."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    for value in range(2, 12):
        size = _symbolic_size(value)
        pieces = chunk_sizes(size, parts)
        assert tuple(optimization_hint(piece) for piece in pieces) == chunk_sizes(value, parts)
        assert (sum(pieces) - size).node.expr == 0
        assert not size.node.shape_env.guards


def test_symbolic_layouts_are_never_hashed_and_keep_explicit_pieces():
    """A layout with a SymInt size (traced by torch.compile) refuses to be a cache key; `with_shape` gives
    an unsharded or chunked dim the new size and keeps explicit pieces; the example sizes come back."""
    rows = _symbolic_size(6)
    example = Layout.create((2,), [Shard(1)], (6, 5), shard_sizes={0: (1, 4)})
    layout = example.with_shape((rows, 5))
    assert layout.is_symbolic and not example.is_symbolic
    with pytest.raises(TypeError, match="symbolic sizes"):
        hash(layout)
    assert layout.pieces == ((rows,), (1, 4)) and layout.explicit_pieces() == (None, (1, 4))
    assert layout.with_example_sizes() == example
    chunked = Layout.create((2,), [Shard(0)], (6, 5)).with_shape((rows, 5))
    assert chunked.explicit_pieces() == (None, None) and chunked.with_example_sizes().pieces == ((3, 3), (5,))
    with pytest.raises(ValueError, match="explicit pieces"):
        example.with_shape((6, 7))
