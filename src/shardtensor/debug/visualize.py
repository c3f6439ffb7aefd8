"""visualize_sharding: which ranks hold which index ranges of a DTensor, as a table in the terminal.

Mirrors `torch.distributed.tensor.debug.visualize_sharding` and goes further: uneven and empty
shards are shown exactly (from the layout's piece sizes), Partial placements are marked, tensors of
3 or more dims are shown one dim at a time, and the text is also returned (on every rank) so that
it can be logged or compared. It is printed once, by the lowest rank of the mesh. `use_rich=True`
prints a coloured grid through `rich` (the optional `viz` extra: `pip install shardtensor[viz]`).

    >>> x = distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0), Shard(1)])  # doctest: +SKIP
    >>> visualize_sharding(x)  # doctest: +SKIP
    shape (8, 8), placements [S(0), S(1)], mesh (2, 2)
              Col 0-3   Col 4-7
    Row 0-3   cpu:0     cpu:1
    Row 4-7   cpu:2     cpu:3
"""

from __future__ import annotations

import collections
import itertools

from ..dtensor import DTensor
from ..placement import Partial, Shard

__all__ = ["visualize_sharding"]

# Background colours of the rich grid, one per distinct cell (cycled).
_RICH_COLOURS = ("blue", "green", "magenta", "cyan", "red", "yellow", "bright_blue", "bright_green",
                 "bright_magenta", "bright_cyan", "bright_red", "bright_yellow")


def _rich_missing_error() -> ImportError:
    return ImportError(
        "visualize_sharding(use_rich=True) needs the optional package `rich`, which is not installed; "
        "install it with `pip install shardtensor[viz]` (or `pip install rich`), or call with use_rich=False "
        "for the plain-text table"
    )


def _holders(dtensor: DTensor) -> dict[tuple[tuple[int, int], ...], list[int]]:
    """For each box of global indices (per dim: first, last + 1) the global ranks that hold it."""
    layout, mesh = dtensor.sharding, dtensor.device_mesh
    boxes: dict[tuple[tuple[int, int], ...], list[int]] = collections.defaultdict(list)
    for coordinate in itertools.product(*(range(size) for size in layout.mesh_shape)):
        offset, shape = layout.local_offset(coordinate), layout.local_shape(coordinate)
        boxes[tuple((start, start + size) for start, size in zip(offset, shape))].append(int(mesh.mesh[coordinate]))
    return boxes


def _range_text(interval: tuple[int, int]) -> str:
    start, end = interval
    return f"{start}-{end - 1}" if end > start else "empty"


def _cell_text(ranks: list[int], device_type: str, partial_text: str) -> str:
    return partial_text + device_type + ":" + ",".join(str(rank) for rank in sorted(ranks))


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["   ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in rows]


def _title(dtensor: DTensor) -> str:
    placements = ", ".join(str(placement) for placement in dtensor.placements)
    return f"shape {tuple(dtensor.shape)}, placements [{placements}], mesh {tuple(dtensor.device_mesh.shape)}"


def _partial_notes(dtensor: DTensor) -> tuple[str, list[str]]:
    """The cell prefix for a Partial tensor, and a line per Partial mesh dim saying what it means."""
    notes = [
        f"{placement} on mesh dim {mesh_dim}: the ranks of a cell hold partial values; their "
        f"{placement.reduce_op} is the value"
        for mesh_dim, placement in enumerate(dtensor.placements)
        if isinstance(placement, Partial)
    ]
    prefix = " ".join(sorted({str(p) for p in dtensor.placements if isinstance(p, Partial)}))
    return (prefix + " " if prefix else ""), notes


def _grid(dtensor: DTensor, boxes, partial_text: str) -> tuple[list[str], list[str], list[list[str]], list[str]]:
    """Row labels, column labels and cells of a 1-D or 2-D tensor (1-D: one row), and empty holders."""
    device_type = dtensor.device_mesh.device_type
    full_boxes = {box: ranks for box, ranks in boxes.items() if all(end > start for start, end in box)}
    empty_ranks = sorted(rank for box, ranks in boxes.items() if box not in full_boxes for rank in ranks)
    if dtensor.ndim == 1:
        columns = sorted({box[0] for box in full_boxes})
        cells = [[_cell_text(full_boxes[(column,)], device_type, partial_text) for column in columns]]
        return ["Ranks"], [f"Index {_range_text(column)}" for column in columns], cells, empty_ranks
    rows = sorted({box[0] for box in full_boxes})
    columns = sorted({box[1] for box in full_boxes})
    cells = [[_cell_text(full_boxes.get((row, column), []), device_type, partial_text) for column in columns]
             for row in rows]
    return ([f"Row {_range_text(row)}" for row in rows], [f"Col {_range_text(column)}" for column in columns],
            cells, empty_ranks)


def _per_dim_lines(dtensor: DTensor, boxes, device_type: str, partial_text: str) -> list[str]:
    """For 3 or more dims: per tensor dim, its index ranges and the ranks holding each."""
    lines = []
    for dim in range(dtensor.ndim):
        mesh_dims = [mesh_dim for mesh_dim, p in enumerate(dtensor.placements) if isinstance(p, Shard) and p.dim == dim]
        how = f"sharded over mesh dims {tuple(mesh_dims)}" if mesh_dims else "not sharded"
        lines.append(f"dim {dim} (size {dtensor.shape[dim]}, {how})")
        by_range: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        for box, ranks in boxes.items():
            by_range[box[dim]].extend(ranks)
        rows = [[f"  {_range_text(interval)}", _cell_text(ranks, device_type, partial_text)]
                for interval, ranks in sorted(by_range.items(), key=lambda item: (item[0][1] <= item[0][0], item[0]))]
        lines += _aligned(rows)
    return lines


def _picture(dtensor: DTensor) -> tuple[list[str], tuple | None, list[str]]:
    """The body of the picture (for 1-D/2-D tensors also the grid, for rich) and the notes below it."""
    partial_text, notes = _partial_notes(dtensor)
    device_type = dtensor.device_mesh.device_type
    boxes = _holders(dtensor)
    if dtensor.numel() == 0:
        return ["(no elements)"], None, notes
    if dtensor.ndim == 0:
        return [_cell_text(next(iter(boxes.values())), device_type, partial_text)], None, notes
    if dtensor.ndim > 2:
        return _per_dim_lines(dtensor, boxes, device_type, partial_text), None, notes
    grid = _grid(dtensor, boxes, partial_text)
    row_labels, column_labels, cells, empty_ranks = grid
    body = _aligned([[""] + column_labels] + [[label] + row for label, row in zip(row_labels, cells)])
    if empty_ranks:
        notes = [f"holding no elements: {device_type}:{','.join(map(str, empty_ranks))}"] + notes
    return body, grid, notes


def _print_rich(head: list[str], body: list[str], grid, notes: list[str]) -> None:
    import rich.console
    import rich.table

    console = rich.console.Console()
    if grid is None:
        console.print("\n".join(head + body + notes), highlight=False)
        return
    console.print("\n".join(head), highlight=False)
    row_labels, column_labels, cells, _ = grid
    table = rich.table.Table(show_lines=True)
    table.add_column("")
    for label in column_labels:
        table.add_column(label, justify="center")
    colours: dict[str, str] = {}
    for label, row in zip(row_labels, cells):
        styled = []
        for cell in row:
            colour = colours.setdefault(cell, _RICH_COLOURS[len(colours) % len(_RICH_COLOURS)])
            styled.append(f"[bold white on {colour}] {cell} [/]")
        table.add_row(label, *styled)
    console.print(table)
    for line in notes:
        console.print(line, highlight=False)


def visualize_sharding(dtensor: DTensor, header: str = "", use_rich: bool = False) -> str:
    """Print which ranks hold which index ranges of `dtensor` (once, on the lowest rank of its mesh).

    1-D and 2-D tensors are shown as a grid of index ranges (inclusive, `Row 0-3`) whose cells
    list the global ranks holding that block; ranks holding an empty shard are listed below the
    grid. Tensors of 3 or more dims are shown one dim at a time. A Partial tensor's cells are marked
    `P(sum)` (the ranks of a cell hold values that add up to the block). Returns the plain text on
    every rank; nothing communicates.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"visualize_sharding takes a DTensor, got {type(dtensor).__name__}; "
                        f"make one with distribute_tensor or DTensor.from_local")
    if use_rich:
        try:
            import rich  # noqa: F401  (checked on every rank, so that every rank raises alike)
        except ImportError as error:
            raise _rich_missing_error() from error
    head = ([header] if header else []) + [_title(dtensor)]
    body, grid, notes = _picture(dtensor)
    mesh = dtensor.device_mesh
    if mesh.get_rank() == int(mesh.mesh.min()):
        if use_rich:
            _print_rich(head, body, grid, notes)
        else:
            print("\n".join(head + body + notes))
    return "\n".join(head + body + notes)
