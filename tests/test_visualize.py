"""visualize_sharding: the exact text for even, uneven, 2x2, Partial, 1-D and 3-D cases, printed once."""

import builtins
import contextlib
import io

import pytest
import torch
from spmd import spmd

from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from shardtensor.debug import visualize_sharding


def _check(text: str, expected: list[str], first_line: int = 0) -> None:
    assert text.splitlines()[first_line:] == expected, "\n" + text


def _shown(dtensor, **options):
    """What visualize_sharding returns and prints on this rank; the lowest rank prints the text, others nothing."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        text = visualize_sharding(dtensor, **options)
    mesh = dtensor.device_mesh
    expected_print = text + "\n" if mesh.get_rank() == int(mesh.mesh.min()) else ""
    assert printed.getvalue() == expected_print
    return text


@spmd(meshes=[(2,)])
def test_even_rows_with_header(mesh):
    x = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    _check(_shown(x, header="weight"), expected=[
        "weight",
        "shape (4, 4), placements [S(0)], mesh (2,)",
        "          Col 0-3",
        "Row 0-1   cpu:0",
        "Row 2-3   cpu:1",
    ])


@spmd(meshes=[(4,)])
def test_uneven_rows_are_exact_and_empty_shards_listed(mesh):
    x = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)])  # torch.chunk: 2, 2, 1, 0 rows
    _check(_shown(x), expected=[
        "shape (5, 3), placements [S(0)], mesh (4,)",
        "          Col 0-2",
        "Row 0-1   cpu:0",
        "Row 2-3   cpu:1",
        "Row 4-4   cpu:2",
        "holding no elements: cpu:3",
    ])
    explicit = DTensor.from_local(torch.zeros(1 + 2 * mesh.get_rank(), 3), mesh, [Shard(0)])  # 1, 3, 5, 7 rows
    _check(_shown(explicit), first_line=2, expected=[
        "Row 0-0    cpu:0",
        "Row 1-3    cpu:1",
        "Row 4-8    cpu:2",
        "Row 9-15   cpu:3",
    ])


@spmd(meshes=[(2, 2)])
def test_two_by_two_mesh_grid_and_replicated_cells(mesh):
    both = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0), Shard(1)])
    _check(_shown(both), expected=[
        "shape (4, 6), placements [S(0), S(1)], mesh (2, 2)",
        "          Col 0-2   Col 3-5",
        "Row 0-1   cpu:0     cpu:1",
        "Row 2-3   cpu:2     cpu:3",
    ])
    columns = distribute_tensor(torch.zeros(4, 6), mesh, [Replicate(), Shard(1)])
    _check(_shown(columns), first_line=1, expected=[
        "          Col 0-2   Col 3-5",
        "Row 0-3   cpu:0,2   cpu:1,3",
    ])
    nested = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0), Shard(0)])
    _check(_shown(nested), first_line=1, expected=[
        "          Col 0-1",
        "Row 0-0   cpu:0",
        "Row 1-1   cpu:1",
        "Row 2-2   cpu:2",
        "Row 3-3   cpu:3",
    ])


@spmd(meshes=[(2,), (2, 2)])
def test_partial_cells_are_marked(mesh):
    placements = [Partial()] + [Shard(1)] * (mesh.ndim - 1)
    x = DTensor.from_local(torch.ones(2, 4 // mesh.size(-1) if mesh.ndim == 2 else 4), mesh, placements)
    text = _shown(x)
    note = "P(sum) on mesh dim 0: the ranks of a cell hold partial values; their sum is the value"
    if mesh.ndim == 1:
        _check(text, expected=[
            "shape (2, 4), placements [P(sum)], mesh (2,)",
            "          Col 0-3",
            "Row 0-1   P(sum) cpu:0,1",
            note,
        ])
    else:
        _check(text, expected=[
            "shape (2, 4), placements [P(sum), S(1)], mesh (2, 2)",
            "          Col 0-1          Col 2-3",
            "Row 0-1   P(sum) cpu:0,2   P(sum) cpu:1,3",
            note,
        ])


@spmd(meshes=[(2,)])
def test_one_dimensional_and_three_dimensional_tensors(mesh):
    vector = distribute_tensor(torch.zeros(7), mesh, [Shard(0)])
    _check(_shown(vector), expected=[
        "shape (7,), placements [S(0)], mesh (2,)",
        "        Index 0-3   Index 4-6",
        "Ranks   cpu:0       cpu:1",
    ])
    cube = distribute_tensor(torch.zeros(2, 5, 3), mesh, [Shard(1)])
    _check(_shown(cube), expected=[
        "shape (2, 5, 3), placements [S(1)], mesh (2,)",
        "dim 0 (size 2, not sharded)",
        "  0-1   cpu:0,1",
        "dim 1 (size 5, sharded over mesh dims (0,))",
        "  0-2   cpu:0",
        "  3-4   cpu:1",
        "dim 2 (size 3, not sharded)",
        "  0-2   cpu:0,1",
    ])
    empty = distribute_tensor(torch.zeros(0, 3), mesh, [Shard(0)])
    _check(_shown(empty), expected=["shape (0, 3), placements [S(0)], mesh (2,)", "(no elements)"])


@spmd(meshes=[(2, 2)])
def test_rich_grid_is_printed_once_with_the_same_cells(mesh):
    x = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0), Shard(1)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        text = visualize_sharding(x, header="rich", use_rich=True)
    assert text.splitlines()[0] == "rich"
    if mesh.get_rank() == 0:
        for cell in ("rich", "Col 0-2", "Col 3-5", "Row 0-1", "Row 2-3", "cpu:0", "cpu:1", "cpu:2", "cpu:3"):
            assert cell in printed.getvalue()
    else:
        assert printed.getvalue() == ""


@spmd(meshes=[(1,)])
def test_rich_missing_names_the_extra(mesh):
    x = distribute_tensor(torch.zeros(2, 2), mesh, [Shard(0)])
    real_import = builtins.__import__

    def without_rich(name, *args, **kwargs):
        if name == "rich" or name.startswith("rich."):
            raise ImportError("No module named 'rich'")
        return real_import(name, *args, **kwargs)

    builtins.__import__ = without_rich
    try:
        with pytest.raises(ImportError, match=r"pip install shardtensor\[viz\]"):
            visualize_sharding(x, use_rich=True)
    finally:
        builtins.__import__ = real_import


def test_a_plain_tensor_is_refused():
    with pytest.raises(TypeError, match="takes a DTensor"):
        visualize_sharding(torch.zeros(2))
