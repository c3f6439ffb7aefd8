"""Context-parallel benchmark: ring attention against gathering k/v, on 4 local ranks (CPU, gloo).

    .venv/bin/python bench/bench_context_parallel.py            # sequence lengths 512, 1024, 2048
    .venv/bin/python bench/bench_context_parallel.py --quick    # 512 only
    .venv/bin/python bench/bench_context_parallel.py --first-call   # ours vs torch, non-causal

Causal attention, forward + backward, batch 1, 4 heads, head dim 32, fp32. Per method and sequence
length: the slowest rank's median time, and peak bytes of live tensors per rank during the call
(tracked with a dispatch mode: every tensor an op creates counts until it dies). Methods: ring
attention with point-to-point rotation ("alltoall") and with one all_gather ("allgather"); and the
plain approach, all_gather k/v then the local SDPA with a causal mask on global positions (backward:
reduce_scatter of dk/dv). Then the causal load balance: attention blocks per rank and measured time
per rank (in blocks of (S/2W)^2 query-key pairs), max/min, with the head-tail order and with contiguous pieces.
`--first-call` instead times the first and second non-causal SDPA forward (sequence 512) under our
`context_parallel` and under torch's, each library on fresh ranks (torch's CPU backward and causal
forward raise, so the comparison is the forward).
"""

from __future__ import annotations

import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 4
SEQUENCES = [512, 1024, 2048]
REPEATS = 3


class PeakMemory(TorchDispatchMode):
    """Peak bytes of storages created by ops inside the mode and still alive (views counted once)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.references: dict[int, int] = {}

    def _release(self, key: int, nbytes: int) -> None:
        self.references[key] -= 1
        if self.references[key] == 0:
            del self.references[key]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if key not in self.references:
                    self.references[key] = 0
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self.references[key] += 1
                weakref.finalize(tensor, self._release, key, nbytes)
        return output


class _GatherSequence(torch.autograd.Function):
    """all_gather along the sequence forward, reduce_scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, tensor, mesh):
        from shardtensor import comm
        ctx.mesh, ctx.size = mesh, tensor.shape[-2]
        return comm.all_gather(tensor, mesh, 0, dim=-2, sizes=[tensor.shape[-2]] * mesh.size(0))

    @staticmethod
    def backward(ctx, grad):
        from shardtensor import comm
        return comm.reduce_scatter(grad.contiguous(), ctx.mesh, 0, reduce_op="sum", dim=-2,
                                   sizes=[ctx.size] * ctx.mesh.size(0)), None


def _gathered_attention(query, key, value, mesh, layout, original_attention):
    """The plain way: gather k/v (and their global positions), one local SDPA with a position mask."""
    positions = torch.arange(layout.chunk_count * query.shape[-2] // layout.chunks_per_rank,
                             device=query.device).chunk(layout.chunk_count)
    coordinate = mesh.get_local_rank(0)
    query_positions = torch.cat([positions[chunk] for chunk in layout.chunks(coordinate)])
    key_positions = torch.cat([positions[chunk] for chunk in layout.global_order()])
    stacked = _GatherSequence.apply(torch.stack([key, value]), mesh)
    mask = query_positions[:, None] >= key_positions[None, :]
    return original_attention(query, stacked[0], stacked[1], attn_mask=mask)


def _run(method, mesh, sequence, load_balance=True):
    """(median seconds, peak bytes) of causal forward + backward on this rank."""
    from shardtensor.experimental import context_parallel, set_rotate_method
    from shardtensor.experimental.ring_attention import SequenceLayout

    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 4, sequence, 32, generator=generator) for _ in range(4)]
    original_attention = F.scaled_dot_product_attention
    layout = SequenceLayout(WORLD, load_balance)
    times, peak = [], 0
    set_rotate_method("allgather" if method == "gather k/v" else method)
    with context_parallel(mesh, buffers=full, buffer_seq_dims=[2] * 4, load_balance=load_balance):
        for _ in range(REPEATS + 1):
            leaves = [tensor.detach().clone().requires_grad_() for tensor in full[:3]]
            torch.distributed.barrier()
            with PeakMemory() as tracker:
                start = time.perf_counter()
                if method == "gather k/v":
                    output = _gathered_attention(*leaves, mesh, layout, original_attention)
                else:
                    output = F.scaled_dot_product_attention(*leaves, is_causal=True)
                output.backward(full[3])
                times.append(time.perf_counter() - start)
            peak = max(peak, tracker.peak)
    set_rotate_method("allgather")
    return statistics.median(times[1:]), peak


def run_rank(sequences):
    from shardtensor.experimental.ring_attention import SequenceLayout
    from shardtensor.mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = []
    for sequence in sequences:
        for method in ("alltoall", "allgather", "gather k/v"):
            seconds, peak = _run(method, mesh, sequence)
            rows.append(("time", sequence, method, seconds, peak))
    for load_balance in (True, False):
        seconds, _ = _run("alltoall", mesh, sequences[-1], load_balance)
        layout = SequenceLayout(WORLD, load_balance)
        units = layout.causal_work(mesh.get_local_rank(0)) * (2 // layout.chunks_per_rank) ** 2  # in (S/2W)^2 blocks
        rows.append(("balance", sequences[-1], load_balance, seconds, units))
    return rows


def first_calls_rank(library: str, sequence: int):
    """[(wall seconds, CPU seconds of this rank)] of the first and second non-causal SDPA forward
    under `library`'s context_parallel ("ours" or "torch") on this fresh rank."""
    if library == "ours":
        from shardtensor.experimental import context_parallel
        from shardtensor.mesh import init_device_mesh
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    generator = torch.Generator().manual_seed(0)
    query, key, value = [torch.randn(1, 4, sequence, 32, generator=generator) for _ in range(3)]
    samples = []
    with context_parallel(mesh, buffers=[query, key, value], buffer_seq_dims=[2, 2, 2]):
        for _ in range(2):
            torch.distributed.barrier()
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            F.scaled_dot_product_attention(query, key, value)
            samples.append((time.perf_counter() - wall_start, time.process_time() - cpu_start))
    return samples


def _first_call_table(first_calls_rank) -> list[str]:
    """Ours and torch's first and second call, wall time of the slowest rank and rank 0's CPU time."""
    from shardtensor import launch

    lines = ["| library (sequence 512, non-causal forward, 4 ranks) | first call wall s (slowest rank) "
             "| first call CPU s (rank 0) | second call wall ms | second call CPU ms (rank 0) |",
             "|---|---:|---:|---:|---:|"]
    cells = {}
    for library in ("ours", "torch"):
        per_rank = launch.spawn(first_calls_rank, WORLD, library, 512)
        walls = [max(rank[call][0] for rank in per_rank) for call in range(2)]
        cpus = [per_rank[0][call][1] for call in range(2)]
        cells[library] = walls, cpus
        lines.append(f"| {library} | {walls[0]:.3f} | {cpus[0]:.3f} | {walls[1] * 1e3:.1f} | {cpus[1] * 1e3:.1f} |")
    (our_walls, our_cpus), (their_walls, their_cpus) = cells["ours"], cells["torch"]
    lines.append(f"| ours/torch | {our_walls[0] / their_walls[0]:.4f} | {our_cpus[0] / their_cpus[0]:.4f} "
                 f"| {our_walls[1] / their_walls[1]:.2f} | {our_cpus[1] / their_cpus[1]:.2f} |")
    return lines


def _table(per_rank):
    lines = ["| sequence | method | time fwd+bwd (ms, slowest rank) | peak MB per rank (max over ranks) |",
             "|---|---|---|---|"]
    for index, row in enumerate(per_rank[0]):
        if row[0] != "time":
            continue
        seconds = max(rank_rows[index][3] for rank_rows in per_rank)
        peak = max(rank_rows[index][4] for rank_rows in per_rank)
        lines.append(f"| {row[1]} | {row[2]} | {seconds * 1e3:.1f} | {peak / 2**20:.2f} |")
    lines += ["", "| causal layout (sequence %d, alltoall) | work per rank ((S/2W)^2 blocks) | work max/min | time per rank (ms) | time max/min |"
              % per_rank[0][-1][1], "|---|---|---|---|---|"]
    for index, row in enumerate(per_rank[0]):
        if row[0] != "balance":
            continue
        blocks = [rank_rows[index][4] for rank_rows in per_rank]
        seconds = [rank_rows[index][3] for rank_rows in per_rank]
        name = "head-tail (2 chunks per rank)" if row[2] else "contiguous (1 chunk per rank)"
        lines.append(f"| {name} | {blocks} | {max(blocks) / min(blocks):.2f} | "
                     f"{[round(value * 1e3, 1) for value in seconds]} | {max(seconds) / min(seconds):.2f} |")
    return lines


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_context_parallel

    from shardtensor import launch

    start = time.perf_counter()
    if "--first-call" in sys.argv:
        print("\n".join(_first_call_table(bench_context_parallel.first_calls_rank)))
    else:
        sequences = [512] if "--quick" in sys.argv else SEQUENCES
        per_rank = launch.spawn(bench_context_parallel.run_rank, WORLD, sequences)
        print("\n".join(_table(per_rank)))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
