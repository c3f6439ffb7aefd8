"""Placement values: equality, text forms and validation."""

import itertools

import pytest

from shardtensor.placement import Partial, Replicate, Shard, normalize_placements


def test_text_forms():
    assert [str(p) for p in (Shard(0), Replicate(), Partial("max"))] == ["S(0)", "R", "P(max)"]
    assert [repr(p) for p in (Shard(1), Replicate(), Partial())] == [
        "Shard(dim=1)", "Replicate()", "Partial(reduce_op='sum')"]


def test_values_hash_and_compare():
    assert {Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum")} == {
        Shard(0), Replicate(), Partial()}
    assert Shard(0) != Shard(1) and Partial("sum") != Partial("avg")


def test_predicates():
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicate() and not Replicate().is_shard()
    assert Partial("max").is_partial() and Partial("max").is_partial("max") and not Partial().is_partial("max")


def test_bad_values():
    with pytest.raises(ValueError, match="allowed reduce ops are sum, avg, max, min, product"):
        Partial("mean")
    with pytest.raises(TypeError, match="int tensor dim"):
        Shard("0")


def test_normalize_placements():
    assert normalize_placements([Shard(-1), Replicate()], 3, 2) == (Shard(2), Replicate())
    with pytest.raises(ValueError, match="got 1 placements for 2 mesh dims"):
        normalize_placements([Shard(0)], 2, 2)
    with pytest.raises(ValueError, match="out of range"):
        normalize_placements([Shard(2)], 2, 1)
    with pytest.raises(TypeError, match="not a Placement"):
        normalize_placements(["S0"], 2, 1)
    with pytest.raises(ValueError, match="sequence of Placement"):
        normalize_placements(Shard(0), 2, 1)


def test_every_placement_is_exported_where_users_import_placements():
    import shardtensor
    from shardtensor import placement, placement_types

    names = ["Placement", "Shard", "Replicate", "Partial", "NormPartial"]
    for module in (shardtensor, placement_types):
        assert set(names) <= set(module.__all__), module.__name__
        assert all(getattr(module, name) is getattr(placement, name) for name in names), module.__name__
    assert str(shardtensor.NormPartial(2)) == "P(2-norm)" and shardtensor.NormPartial(2).is_partial()


def test_local_shard_size_and_offset_and_reduce_op_lists_match_torch():
    """`Shard.local_shard_size_and_offset` follows torch.chunk as DTensor's does, empty pieces included."""
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Shard as TorchShard

    for size, num_chunks in itertools.product(range(12), range(1, 6)):
        for rank in range(num_chunks):
            expected = TorchShard.local_shard_size_and_offset(size, num_chunks, rank)
            assert Shard.local_shard_size_and_offset(size, num_chunks, rank) == expected
    assert set(Partial.ALL_REDUCE_OPS) == set(TorchPartial.ALL_REDUCE_OPS)
    assert set(Partial.LINEAR_REDUCE_OPS) == set(TorchPartial.LINEAR_REDUCE_OPS)
