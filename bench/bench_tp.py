"""A training step of the demo's GPT with tensor parallelism: shardtensor vs torch.distributed.tensor.parallel.

    .venv/bin/python bench/bench_tp.py               # TP=2 (mesh 1x2) and DP x TP = 2x2; table for bench/README.md
    .venv/bin/python bench/bench_tp.py --steps 5     # shorter

Both libraries run the same model (same weights), the same plan (ours converted style by style
to torch's classes of the same names: a user's switch of imports), the same data-parallel
gradient averaging and AdamW (the norm gradients that sequence parallelism leaves Partial over "tp":
ours sums them over "tp" in one all_reduce at the end of backward, then averages everything in one
all_reduce over "dp"; torch's stay Partial, so its averaging takes one all_reduce over "dp" and one
over the whole mesh for them), in the same worker processes, alternating step by
step so both see the same machine load. Reported per step: the slowest rank's median wall time,
the ratio ours/torch, the collectives (ours from `comm.observe()`, torch's from its
`CommDebugMode`, which also sees c10d calls: gradient averaging included in both), and per rank the bytes of parameters,
gradients, optimizer state and the activations saved for backward (local shards; CPU has no
allocator peak to read).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtensor import comm
from shardtensor.demo.data import batch_for_step, load_corpus
from shardtensor.demo.model import GPT, GPTConfig, tensor_parallel_plan
from shardtensor.demo.train import average_gradients, forward_backward
from shardtensor.launch import LocalWorkers
from shardtensor.mesh import init_device_mesh
from shardtensor.parallel import ParallelStyle, parallelize_module
from shardtensor.placement import Replicate, Shard

CONFIG = dict(block_size=64, layers=2, heads=4, width=64)
BATCH = 16


def torch_plan(value):
    """Our plan as torch's: each style by the same class name, each placement by torch's."""
    import torch.distributed.tensor as torch_tensor
    import torch.distributed.tensor.parallel as torch_parallel

    if isinstance(value, ParallelStyle):
        fields = {f.name: torch_plan(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "src_data_rank"}
        return getattr(torch_parallel, type(value).__name__)(**fields)
    if isinstance(value, Shard):
        return torch_tensor.Shard(value.dim)
    if isinstance(value, Replicate):
        return torch_tensor.Replicate()
    if isinstance(value, dict):
        return {key: torch_plan(entry) for key, entry in value.items()}
    return value


def torch_average_gradients(parameters, dp_group, dp_size, tp_mesh) -> None:
    """The averaging torch's DTensor needs: one all_reduce over dp, one over the whole mesh for the
    gradients it leaves Partial over tp (ours reduces those over tp in backward instead)."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Replicate as TorchReplicate

    for partial in (False, True):
        group = [p for p in parameters if any(x.is_partial() for x in p.grad.placements) == partial]
        if not group:
            continue
        flat = torch.cat([p.grad.to_local().reshape(-1) for p in group])
        dist.all_reduce(flat, group=None if partial else dp_group)
        flat /= dp_size
        for parameter, piece in zip(group, flat.split([p.grad.to_local().numel() for p in group])):
            local = piece.view_as(parameter.grad.to_local())
            if partial:
                parameter.grad = TorchDTensor.from_local(local, tp_mesh, [TorchReplicate()], run_check=False)
            else:
                parameter.grad.to_local().copy_(local)


class SavedBytes:
    """Bytes of the local tensors autograd saves for backward (activations) in a block."""

    def __init__(self):
        self.total = 0

    def pack(self, tensor):
        local = getattr(tensor, "_local_tensor", tensor)
        self.total += local.numel() * local.element_size()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def _local_bytes(tensors) -> int:
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for t in tensors if t is not None)


def _state_bytes(model, optimizer) -> int:
    states = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value) and value.ndim]
    return _local_bytes(model.parameters()) + _local_bytes(p.grad for p in model.parameters()) + _local_bytes(states)


def body(mesh_shape, steps):
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    theirs_mesh = torch_init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    corpus = load_corpus(None, CONFIG["block_size"])
    torch.manual_seed(0)
    ours = GPT(GPTConfig(corpus.vocab_size, **CONFIG))
    theirs = copy.deepcopy(ours)
    parallelize_module(ours, mesh["tp"], tensor_parallel_plan(), src_data_rank=None)
    torch_parallelize_module(theirs, theirs_mesh["tp"], torch_plan(tensor_parallel_plan()), src_data_rank=None)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True) for name, model in (("ours", ours), ("torch", theirs))}
    dp = mesh.get_coordinate()[0]

    def our_step(tokens, targets):
        loss = forward_backward(ours, tokens, targets)
        average_gradients(list(ours.parameters()), mesh, loss)
        optimizers["ours"].step()

    def their_step(tokens, targets):
        with torch_loss_parallel():
            loss = F.cross_entropy(theirs(tokens).flatten(0, 1), targets.flatten(0, 1))
            loss.backward()
        torch_average_gradients(list(theirs.parameters()), theirs_mesh.get_group("dp"), mesh_shape[0], theirs_mesh["tp"])
        optimizers["torch"].step()

    times = {"ours": [], "torch": []}
    counts, memory = {}, {}
    for step in range(steps + 2):
        tokens, targets = (t.tensor_split(mesh_shape[0])[dp] for t in batch_for_step(corpus, step, BATCH, CONFIG["block_size"], 0))
        for name, run in (("ours", our_step), ("torch", their_step)):
            optimizers[name].zero_grad(set_to_none=True)
            dist.barrier()
            began = time.perf_counter()
            if step == 1:  # a warm step: count collectives and saved activations
                counter = comm.observe() if name == "ours" else CommDebugMode()
                with counter as records, SavedBytes() as saved:
                    run(tokens, targets)
                counts[name] = len(records) if name == "ours" else counter.get_total_counts()
                memory[name] = saved.total + _state_bytes(ours if name == "ours" else theirs, optimizers[name])
            else:
                run(tokens, targets)
            if step >= 2:
                times[name].append(time.perf_counter() - began)
    return times, counts, memory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    arguments = parser.parse_args()
    print("| mesh (dp x tp) | ours step (ms) | torch step (ms) | ratio | ours collectives | torch collectives | ours MiB/rank | torch MiB/rank |")
    print("|---|---|---|---|---|---|---|---|")
    for mesh_shape in ((1, 2), (2, 2)):
        with LocalWorkers(mesh_shape[0] * mesh_shape[1], timeout=600) as workers:
            results = workers.run(body, mesh_shape, arguments.steps)
        slowest = {name: [max(rank[0][name][i] for rank in results) for i in range(arguments.steps)] for name in ("ours", "torch")}
        ours_ms, torch_ms = (statistics.median(slowest[name]) * 1e3 for name in ("ours", "torch"))
        counts, memory = results[0][1], results[0][2]
        print(
            f"| {mesh_shape[0]}x{mesh_shape[1]} | {ours_ms:.1f} | {torch_ms:.1f} | {ours_ms / torch_ms:.2f} | "
            f"{counts['ours']} | {counts['torch']} | {memory['ours'] / 2**20:.2f} | {memory['torch'] / 2**20:.2f} |"
        )


if __name__ == "__main__":
    main()
