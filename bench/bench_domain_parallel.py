"""A conv stack on a spatially sharded 2-D field: halo bytes vs gathering, step time vs one process,
and what PyTorch DTensor does with the same input.

    .venv/bin/python bench/bench_domain_parallel.py            # 512x512 field; the table for bench/README.md
    .venv/bin/python bench/bench_domain_parallel.py --quick    # 256x256, fewer steps

The model: `LAYERS` x (3x3 'same' convolution, `CHANNELS` -> `CHANNELS`, ReLU) on a (1, CHANNELS, S, S)
float32 field, replicated parameters, forward + backward of `sum(output * grad)` (the field requires
grad, so every layer sends its halo gradients back). Four local gloo ranks, the field split along H
(4 ranks: even and uneven shard sizes) or H and W (2x2, uneven). Per layout:
- bytes: the most any rank receives in one step (`comm.observe()`), the field's point-to-point halo
  and the all_reduce of the parameter gradients apart; next to the exact halo (each neighbour's rows
  once forward, once backward: the window's gradient, the window itself rebuilt from the forward's
  kept halo; on 2x2 the column exchange runs on the tensor widened along H) and to gathering (every layer all_gathers its input forward and its
  output gradient backward: the field minus the rank's own piece, twice per layer);
- time: the slowest rank's median step, next to one process running the same step on the whole
  field (one thread each: the 4 ranks share the machine's cores with everyone else).
PyTorch DTensor (torch.distributed.tensor) runs `F.conv2d` on a Shard(2) input without a halo: its
result is labelled Replicate but holds only each rank's piece. We report that and do not time it.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn
from timing import call_times

CHANNELS, LAYERS = 8, 4
ITEMSIZE = 4  # float32

# name -> (mesh shape, placements as tensor dims, shard sizes as fractions of 16 per mesh dim, or None)
LAYOUTS = {
    "H over 4, even": ((4,), (2,), None),
    "H over 4, uneven 5/3/4/4": ((4,), (2,), {0: (5, 3, 4, 4)}),
    "H x W over 2x2, uneven 9/7 x 6/10": ((2, 2), (2, 3), {0: (9, 7), 1: (6, 10)}),
}


def conv_stack() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers)


def _step(model, field, grad):
    """One forward + backward; returns the output (detached)."""
    output = model(field)
    (output * grad).sum().backward()
    return output.detach()


def _median_ms(function, steps: int, barrier=None) -> float:
    return statistics.median(call_times(function, steps, before=barrier)) * 1e3


def _exact_halo_bytes(local_height: int, local_width: int, neighbours: list[int], two_dims: bool) -> int:
    """What one rank receives for one layer: neighbour rows (then columns of the H-widened tensor),
    once forward and once backward (the window's gradient; the window comes from the kept halo)."""
    rows = neighbours[0] * CHANNELS * local_width * ITEMSIZE
    columns = neighbours[1] * CHANNELS * (local_height + 2) * ITEMSIZE if two_dims else 0
    return 2 * (rows + columns)


def _sharded(full, mesh, placements, shard_sizes):
    from shardtensor import DTensor
    from shardtensor.layout import Layout

    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=shard_sizes)
    local = full
    for dim, (start, length) in enumerate(zip(layout.local_offset(mesh.get_coordinate()),
                                              layout.local_shape(mesh.get_coordinate()))):
        local = local.narrow(dim, start, length)
    return DTensor.from_local(local.clone(), mesh, placements, shape=full.shape, shard_sizes=shard_sizes)


def _ours(name, size, steps, full, grad, reference_output):
    import torch.distributed as dist

    from shardtensor import Shard, comm, distribute_module, init_device_mesh

    mesh_shape, dims, sixteenths = LAYOUTS[name]
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(dim) for dim in dims]
    shard_sizes = None if sixteenths is None else {
        mesh_dim: [size * part // 16 for part in parts] for mesh_dim, parts in sixteenths.items()}
    model = distribute_module(conv_stack(), mesh)
    field = _sharded(full, mesh, placements, shard_sizes).requires_grad_()
    grad_field = _sharded(grad, mesh, placements, shard_sizes)
    output = _step(model, field, grad_field)  # warm: decisions cached
    difference = (output.full_tensor() - reference_output).abs().max().item()
    with comm.observe() as records:
        _step(model, field, grad_field)
    halo = sum(record.bytes_received for record in records if record.kind == "batch_p2p")
    reductions = sum(record.bytes_received for record in records if record.kind == "all_reduce")
    others = sorted({record.kind for record in records} - {"batch_p2p", "all_reduce"})
    milliseconds = _median_ms(lambda: _step(model, field, grad_field), steps, dist.barrier)
    coordinate = mesh.get_coordinate()
    neighbours = [sum(1 for side in (0, mesh.size(mesh_dim) - 1) if coordinate[mesh_dim] != side)
                  for mesh_dim in range(mesh.ndim)]
    local_height, local_width = field.to_local().shape[2:]
    exact = LAYERS * _exact_halo_bytes(local_height, local_width, neighbours, mesh.ndim == 2)
    gather = 2 * LAYERS * (full.numel() - field.to_local().numel()) * ITEMSIZE
    return {"ms": milliseconds, "halo": halo, "exact": exact, "reductions": reductions, "gather": gather,
            "others": others, "difference": difference}


def _torch_dtensor(full):
    """PyTorch DTensor's conv2d on a Shard(2) field: what it returns (it has no halo exchange)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    conv = distribute_module(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), mesh)
    reference = conv_stack()[0]
    with torch.no_grad():
        conv.weight.copy_(distribute_tensor(reference.weight, mesh, conv.weight.placements))
        conv.bias.copy_(distribute_tensor(reference.bias, mesh, conv.bias.placements))
    try:
        output = conv(distribute_tensor(full, mesh, [Shard(2)]))
        result = output.full_tensor()
        expected = reference(full)
        if result.shape != expected.shape:
            return f"placements {list(output.placements)}, full_tensor() shape {tuple(result.shape)} (expected {tuple(expected.shape)})"
        return f"placements {list(output.placements)}, max |diff| {(result - expected).abs().max().item():.3g}"
    except Exception as error:  # noqa: BLE001 (reported, not hidden)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def _rank_body(size: int, steps: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    full = torch.randn(1, CHANNELS, size, size, generator=generator)
    grad = torch.randn(1, CHANNELS, size, size, generator=generator)
    model = conv_stack()
    reference_output = _step(model, full.clone().requires_grad_(), grad)
    results = {name: _ours(name, size, steps, full, grad, reference_output) for name in LAYOUTS}
    one_process = None
    if dist.get_rank() == 0:  # the others wait: the one-process step runs alone
        one_process = _median_ms(lambda: _step(model, full.clone().requires_grad_(), grad), steps)
    dist.barrier()
    torch_result = _torch_dtensor(full)
    return results, one_process, torch_result


def main() -> None:
    from shardtensor.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="side of the square field (a multiple of 16)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--quick", action="store_true", help="256x256, 3 steps")
    options = parser.parse_args()
    size, steps = (256, 3) if options.quick else (options.size, options.steps)
    answers = spawn(_rank_body, 4, size, steps)
    one_process = answers[0][1]
    field_bytes = CHANNELS * size * size * ITEMSIZE
    print(f"conv stack: {LAYERS} x (conv 3x3 {CHANNELS}->{CHANNELS} + ReLU) on a (1, {CHANNELS}, {size}, {size}) "
          f"float32 field ({field_bytes / 1e6:.1f} MB), forward + backward, 4 ranks; per step, the most any rank "
          f"receives\n")
    print("| layout | halo received (KB) | exact halo (KB) | halo/exact | gathering (KB) | halo/gathering "
          "| param-grad all_reduce (KB) | other collectives | step, 4 ranks (ms) | one process (ms) | speedup "
          "| max abs diff vs one device |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for name in LAYOUTS:
        ranks = [answer[0][name] for answer in answers]
        worst = max(ranks, key=lambda result: result["halo"])
        exact_ratio = max(result["halo"] / result["exact"] for result in ranks)
        milliseconds = max(result["ms"] for result in ranks)
        print(f"| {name} | {worst['halo'] / 1e3:.1f} | {worst['exact'] / 1e3:.1f} | {exact_ratio:.2f} "
              f"| {worst['gather'] / 1e3:.1f} | {worst['halo'] / worst['gather']:.4f} "
              f"| {max(r['reductions'] for r in ranks) / 1e3:.2f} | {', '.join(worst['others']) or 'none'} "
              f"| {milliseconds:.1f} | {one_process:.1f} | {one_process / milliseconds:.2f} "
              f"| {max(r['difference'] for r in ranks):.1e} |")
    print(f"\nPyTorch DTensor, F.conv2d on the field sharded Shard(2) over 4 ranks (rank 0): {answers[0][2]}")


if __name__ == "__main__":
    main()
