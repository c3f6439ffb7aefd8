"""Compiled training steps: shardtensor and torch.distributed.tensor, the same programs under torch.compile.

    .venv/bin/python bench/bench_compile.py                      # every row: TP MLP on 2 and 4 ranks, FSDP x TP on 2x2
    .venv/bin/python bench/bench_compile.py --rows tp2 --backends aot_eager --steps 3

Rows (issue 24, item 6):
- `tpN`: an MLP (Linear, ReLU, Linear) laid out by `parallelize_module` with ColwiseParallel /
  RowwiseParallel on N ranks (ours from `shardtensor.parallel`, torch's from
  `torch.distributed.tensor.parallel`), `torch.compile(model, backend=...)`; backward and AdamW run
  eagerly after the compiled forward (AOT autograd compiles the backward graph too).
- `fsdp_tp`: two transformer blocks (LayerNorm, causal attention over local heads, LayerNorm, MLP) with
  TP on "tp" (Colwise q/k/v/fc, Rowwise out/proj), each block `.compile()`d, then `fully_shard` over "dp"
  per block and at the root (the torchtitan order), on a 2x2 mesh; each dp rank trains on its slice of the batch.

Fair compile times: every world first compiles, with the row's backend, a plain-tensor function with a
functional all_reduce, forward and backward (`_warm_up`), so the compiler's one-time costs (imports,
code caches, collective lowering) fall on neither side; then the one-process model, then both sides,
and by default each row and backend runs twice, in two fresh worlds, once with ours compiled first and
once with torch's (the `first` column; `--first ours` runs one order). Read each side's compile time
from the world where it went first: it is then, as for a user of one library, the first distributed
program compiled in its process (after the one-process model, whose `forward` code object it shares, so
its compile is dynamo's second cache entry of that frame, the second side's the third).

Each side is compiled with `fullgraph=True` first; if that fails it is compiled again without it and
the table says `no` in the fullgraph column (the first line of the fullgraph error is listed below the
table). Reported per row, backend and side: the first step's wall time (compile time: forward and backward
graphs) and its CPU time (the slowest rank's `process_time`: on a loaded machine the wall time is mostly
waiting for a core), the compiled step (slowest rank's median and minimum over the timed steps, ours and
torch's alternating step by step), that step over the same model compiled on one process (every rank runs it at once, so the
machine's load is alike), ours/torch, collectives per step as each library's own CommDebugMode counts
them and as gloo saw them (profiler events `gloo:*`, the same yardstick for both), the graph breaks of
the first steps (`torch._dynamo.utils.counters["graph_break"]`), and the largest difference of the loss
and of the parameters from the same program run eagerly after `--steps` steps. A side that fails prints its
error's first line instead of numbers.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WIDTH, HIDDEN, BATCH = 64, 256, 32  # the TP MLP
BLOCK_WIDTH, HEADS, SEQUENCE, BLOCK_BATCH, BLOCKS = 64, 4, 32, 8, 2  # the FSDP x TP blocks
SIDES = ("ours", "torch")


class MLP(nn.Module):
    def __init__(self, width=WIDTH, hidden=HIDDEN):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block; the head count is read from the q projection's local width, so
    the same code runs on a TP shard (local heads) and on one process."""

    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(BLOCK_WIDTH)
        self.q, self.k, self.v = (nn.Linear(BLOCK_WIDTH, BLOCK_WIDTH) for _ in range(3))
        self.out = nn.Linear(BLOCK_WIDTH, BLOCK_WIDTH)
        self.mlp_norm = nn.LayerNorm(BLOCK_WIDTH)
        self.mlp = MLP(BLOCK_WIDTH, 4 * BLOCK_WIDTH)

    def forward(self, x):
        batch, length, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (p(h).view(batch, length, -1, BLOCK_WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, -1))
        return x + self.mlp(self.mlp_norm(x))


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(BLOCK_WIDTH, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _libraries(side):
    """(init_device_mesh, parallelize_module, ColwiseParallel, RowwiseParallel, fully_shard, CommDebugMode) of a side."""
    if side == "ours":
        from shardtensor.debug import CommDebugMode
        from shardtensor.fsdp import fully_shard
        from shardtensor.mesh import init_device_mesh
        from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    return init_device_mesh, parallelize_module, ColwiseParallel, RowwiseParallel, fully_shard, CommDebugMode


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _first_line(error: BaseException) -> str:
    """The error's first line; for dynamo's wrapped errors also the inner error (`got ...`) and the
    last frame of shardtensor's source in its user-code trace, which say more than the wrapper."""
    text = f"{type(error).__name__}: {error}".strip()
    line = text.splitlines()[0][:200]
    if "): got " in text:
        line += " [got " + text.split("): got ", 1)[1].splitlines()[0][:200] + "]"
    frames = re.findall(r'File "[^"]*/(shardtensor/[^"]+)", line (\d+), in (\w+)', text)
    if frames:
        line += " [at {}:{} {}]".format(*frames[-1])
    return line.replace("|", "/")


class Setup:
    """One row's model for one side (or for one process: side None), built from the same seed,
    laid out, optionally compiled; `batch(step)` is this rank's input for a step."""

    def __init__(self, row, side, compile_options):
        torch.manual_seed(0)
        self.row, self.side = row, side
        self.model = MLP() if row.startswith("tp") else Blocks()
        ranks = dist.get_world_size()
        if row.startswith("tp"):
            if side is not None:
                init_device_mesh, parallelize_module, Colwise, Rowwise, _, _ = _libraries(side)
                mesh = init_device_mesh("cpu", (ranks,))
                parallelize_module(self.model, mesh, {"up": Colwise(), "down": Rowwise()})
            if compile_options is not None:
                self.model = torch.compile(self.model, **compile_options)
            self.dp_rank, self.dp_size = 0, 1
        else:
            if side is not None:
                init_device_mesh, parallelize_module, Colwise, Rowwise, fully_shard, _ = _libraries(side)
                mesh = init_device_mesh("cpu", (2, ranks // 2), mesh_dim_names=("dp", "tp"))
                plan = {name: Colwise() for name in ("q", "k", "v", "mlp.up")} | {name: Rowwise() for name in ("out", "mlp.down")}
                for block in self.model.blocks:
                    parallelize_module(block, mesh["tp"], plan)
            if compile_options is not None:
                for block in self.model.blocks:
                    block.compile(**compile_options)
            if side is not None:
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(self.model, mesh=mesh["dp"])
                self.dp_rank, self.dp_size = mesh.get_coordinate()[0], 2
            else:
                self.dp_rank, self.dp_size = 0, 1
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def batch(self, step):
        generator = torch.Generator().manual_seed(step)
        if self.row.startswith("tp"):
            return torch.randn(BATCH, WIDTH, generator=generator)
        full = torch.randn(BLOCK_BATCH, SEQUENCE, BLOCK_WIDTH, generator=generator)
        return full.tensor_split(self.dp_size)[self.dp_rank]

    def step(self, step):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.batch(step)).square().mean()
        loss.backward()
        self.optimizer.step()
        return _full(loss).detach().clone()

    def parameters(self):
        return [_full(p).detach().clone() for p in self.model.parameters()]


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _gloo_ops(run) -> int:
    """Collectives gloo ran during `run()`: profiler events named `gloo:<collective>` (barriers excluded)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return sum(1 for event in profile.events() if event.name.startswith("gloo:") and "barrier" not in event.name)


def _comm_mode_count(side, run):
    """The collectives CommDebugMode counts in `run()`. Torch's is a dispatch mode that dynamo does not
    compile under (it skips the frames), so its count is of the step run eagerly: marked so."""
    mode = _libraries(side)[5]()
    with mode:
        run()
    return f"{mode.get_total_counts()}" if side == "ours" else f"{mode.get_total_counts()} eager"


def _warm_up(backend) -> None:
    """Compile, with `backend`, a plain-tensor function with a functional all_reduce, forward and backward:
    the compiler's first-use costs (imports, code caches, collective lowering) that would otherwise fall on
    whichever side compiles first."""
    from torch.distributed import _functional_collectives as functional

    def program(x):
        return (x.relu() * functional.all_reduce(x.detach() * 2, "sum", dist.group.WORLD)).square().mean()

    compiled = torch.compile(program, fullgraph=True, **({"backend": backend} if backend != "inductor" else {}))
    compiled(torch.randn(8, 8, requires_grad=True)).backward()
    torch._dynamo.reset()


def _compiled_side(row, side, backend, steps):
    """Compile one side (fullgraph first), run `steps` steps; returns its Setup and a result dict."""
    result = {}
    for fullgraph in (True, False):
        torch._dynamo.utils.counters.clear()
        try:
            options = {"fullgraph": True} if fullgraph else {}
            if backend != "inductor":
                options["backend"] = backend
            setup = Setup(row, side, options)
            dist.barrier()
            began, began_cpu = time.perf_counter(), time.process_time()
            losses = [setup.step(0)]
            result["compile_s"] = time.perf_counter() - began
            result["compile_cpu_s"] = time.process_time() - began_cpu
            losses += [setup.step(step) for step in range(1, steps)]
        except Exception as error:  # noqa: BLE001 - a failing side is reported, not fatal
            result["fullgraph_error" if fullgraph else "error"] = _first_line(error)
            torch._dynamo.reset()
            dist.barrier()
            continue
        result.update(fullgraph=fullgraph, breaks=_graph_breaks(), losses=losses, parameters=setup.parameters())
        return setup, result
    return None, result


def _eager_values(row, side, steps):
    setup = Setup(row, side, None)
    losses = [setup.step(step) for step in range(steps)]
    return losses, setup.parameters()


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _eager_or_error(row, side, steps):
    try:
        return _eager_values(row, side, steps)
    except Exception as error:  # noqa: BLE001
        return _first_line(error)
    finally:
        dist.barrier()


def _compare(result, eager) -> None:
    """Replace a compiled side's losses and parameters by their largest differences from eager."""
    losses, parameters = result.pop("losses", None), result.pop("parameters", None)
    if isinstance(eager, str):
        result["eager_error"] = eager
    elif losses is not None:
        result["loss_diff"] = _max_diff(losses, eager[0])
        result["param_diff"] = _max_diff(parameters, eager[1])


def _count_collectives(setups, step, results) -> None:
    """Gloo's count of every side first, then CommDebugMode's. Ours counts the compiled step (docs/compile.md,
    "Counting a compiled step's collectives"); torch's cannot: dynamo compiles no frame under its dispatch
    mode, so the step runs eagerly (marked "eager"), or fails ("found no compiled frames" with fullgraph:
    n/a; seen on main, where it failed for both sides).
    Gloo's come first because torch's compiled fully_shard x TP step once failed in its sharding
    propagation (`Attempt to trace generator`) after a side had failed under CommDebugMode."""
    for side, setup in setups.items():
        results[side]["gloo_ops"] = _gloo_ops(lambda: setup.step(step))
    for side, setup in setups.items():
        try:
            results[side]["comm_mode"] = _comm_mode_count(side, lambda: setup.step(step + 1))
        except Exception as error:  # noqa: BLE001
            results[side]["comm_mode"] = "n/a"
            results[side]["comm_mode_error"] = _first_line(error)


def body(rows, backends, steps, timed, eager_first, sides=SIDES, order=SIDES):
    """Every row on this world: per backend, the one-process model compiled (which also warms the
    backend up), then both sides in `order`, timings alternating step by step; the eager runs the
    values are compared with come last (or first with `eager_first`)."""
    torch._dynamo.config.cache_size_limit = 64
    ranks = dist.get_world_size()
    report = {}
    for row in rows:
        eager = {side: _eager_or_error(row, side, steps) for side in sides} if eager_first else {}
        for backend in backends:
            _warm_up(backend)
            single = Setup(row, None, {"backend": backend} if backend != "inductor" else {})
            dist.barrier()
            began = time.perf_counter()
            single.step(0)
            single_compile = time.perf_counter() - began
            setups, results = {}, {}
            for side in order:
                if side in sides:
                    setups[side], results[side] = _compiled_side(row, side, backend, steps)
                else:
                    setups[side], results[side] = None, {"error": "not run (--sides)"}
            times = {name: [] for name in ("single", *SIDES)}
            runners = {"single": single, **{side: setups[side] for side in SIDES if setups[side] is not None}}
            for step in range(steps, steps + timed):
                for name, setup in runners.items():
                    dist.barrier()
                    began = time.perf_counter()
                    setup.step(step)
                    times[name].append(time.perf_counter() - began)
            _count_collectives({side: setup for side, setup in setups.items() if setup is not None}, steps + timed, results)
            report[(row, ranks, backend)] = {"times": times, "single_compile_s": single_compile, **results}
        for side in sides:
            eager.setdefault(side, _eager_or_error(row, side, steps))
            for backend in backends:
                _compare(report[(row, ranks, backend)][side], eager[side])
    return report


def _slowest(per_rank_times, summary=statistics.median):
    """`summary` (median or min) over the timed steps of the slowest rank's time at each step."""
    steps = len(per_rank_times[0])
    if steps == 0:
        return math.nan
    return summary(max(rank[i] for rank in per_rank_times) for i in range(steps))


def print_table(report_by_rank, notes, first_side):
    """One table row per (row, ranks, backend); cells are `ours / torch`; `first_side` compiled first."""
    for key, rank_reports in report_by_rank.items():
        row, ranks, backend = key
        first = rank_reports[0]
        medians = {name: _slowest([r["times"][name] for r in rank_reports]) * 1e3 for name in ("single", *SIDES)}
        minima = {name: _slowest([r["times"][name] for r in rank_reports], min) * 1e3 for name in ("single", *SIDES)}
        cells = {side: first[side] for side in SIDES}
        failed = {side: "error" in cells[side] or "compile_s" not in cells[side] for side in SIDES}
        for side in SIDES:
            for what in ("fullgraph_error", "error", "eager_error", "comm_mode_error"):
                if what in cells[side]:
                    notes.append(f"{row} x{ranks} {backend} {side} {what.replace('_', ' ')}: {cells[side][what]}")

        def get(side, name, fmt="{}"):
            return "fails" if failed[side] or name not in cells[side] else fmt.format(cells[side][name])

        def cpu(side):  # the slowest rank's CPU seconds of the compiling step
            return "fails" if failed[side] else f"{max(r[side]['compile_cpu_s'] for r in rank_reports):.2f}"

        ratio = medians["ours"] / medians["torch"] if not any(failed.values()) else math.nan
        min_ratio = minima["ours"] / minima["torch"] if not any(failed.values()) else math.nan
        print(
            f"| {row} | {ranks} | {backend} | {first_side} | "
            f"{get('ours', 'fullgraph', '{!s}').replace('True', 'yes').replace('False', 'no')} / "
            f"{get('torch', 'fullgraph', '{!s}').replace('True', 'yes').replace('False', 'no')} | "
            f"{get('ours', 'compile_s', '{:.1f}')} / {get('torch', 'compile_s', '{:.1f}')} ({first['single_compile_s']:.1f}) | "
            f"{cpu('ours')} / {cpu('torch')} | "
            f"{medians['ours']:.1f} / {medians['torch']:.1f} ({medians['single']:.1f}) | "
            f"{minima['ours']:.1f} / {minima['torch']:.1f} ({minima['single']:.1f}) | "
            f"{medians['ours'] / medians['single']:.2f} / {medians['torch'] / medians['single']:.2f} | {ratio:.2f} ({min_ratio:.2f}) | "
            f"{get('ours', 'comm_mode')} / {get('torch', 'comm_mode')} | "
            f"{get('ours', 'gloo_ops')} / {get('torch', 'gloo_ops')} | "
            f"{get('ours', 'breaks')} / {get('torch', 'breaks')} | "
            f"{get('ours', 'loss_diff', '{:.1e}')} / {get('torch', 'loss_diff', '{:.1e}')} | "
            f"{get('ours', 'param_diff', '{:.1e}')} / {get('torch', 'param_diff', '{:.1e}')} |",
            flush=True,
        )


def main() -> None:
    from shardtensor.launch import LocalWorkers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["tp2", "tp4", "fsdp_tp"], choices=["tp2", "tp4", "fsdp_tp"])
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--steps", type=int, default=3, help="steps compared with eager (the first one compiles)")
    parser.add_argument("--timed", type=int, default=20, help="timed steps after those")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES, help="run only these sides")
    parser.add_argument("--eager-first", action="store_true", help="run the eager reference before compiling (default: after)")
    parser.add_argument(
        "--first", nargs="+", default=list(SIDES), choices=SIDES,
        help="the side compiled first in a fresh world; each one given is a world of its own (default: both orders)",
    )
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| row | ranks | backend | first | fullgraph | compile s (one process) | compile CPU s | step ms median (one process) | step ms min | "
        "dist / one process | ours / torch median (min) | collectives (CommDebugMode) | gloo ops | graph breaks | "
        "loss diff vs eager | param diff vs eager |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for row in options.rows:
        ranks = 2 if row == "tp2" else 4
        for backend in options.backends:  # a fresh world per row, backend and order: a crash loses one row
            for first in options.first:
                order = (first, *(side for side in SIDES if side != first))
                try:
                    with LocalWorkers(ranks, timeout=1800) as workers:
                        arguments = ([row], [backend], options.steps, options.timed, options.eager_first, options.sides, order)
                        reports = workers.run(body, *arguments, timeout=3600)
                except Exception as error:  # noqa: BLE001 - e.g. a worker's segfault
                    print(f"| {row} | {ranks} | {backend} | {first} | crashed: {_first_line(error)} |", flush=True)
                    notes.append(f"{row} x{ranks} {backend} {first} first: " + " ".join(str(error).split())[:400])
                    continue
                print_table({key: [r[key] for r in reports] for key in reports[0]}, notes, first)
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
