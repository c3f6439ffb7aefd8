"""Programs exit with code 0 without calling destroy_process_group: under torchrun and under spawn.

Left to interpreter exit, a gloo group's worker threads may drop their last tensors while Python
finalizes, which aborts the rank ("terminate called without an active exception", exit code -6);
the library destroys what it created first (`mesh.release_process_groups`).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtensor import Shard, distribute_tensor, init_device_mesh, launch, mesh as mesh_module

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_no_destroy.py"
RUNS = 3  # launched together: a torchrun job costs mostly interpreter start-up


@pytest.mark.xfail(
    strict=False,
    reason="issue 12 item 6 is not fixed: CI on 2026-11-23 still saw a rank abort at interpreter exit "
    "('terminate called without an active exception', SIGABRT) although release_process_groups ran at exit",
)
def test_torchrun_jobs_without_destroy_process_group_all_exit_zero():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(SCRIPT)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
            for _ in range(RUNS)]
    for run, job in enumerate(jobs):
        stdout, stderr = job.communicate(timeout=300)
        code = job.returncode
        assert code == 0, f"torchrun job {run} of {RUNS} exited with {code}:\n{stderr[-3000:]}"
        assert sorted(line for line in stdout.splitlines() if line.endswith("done")) == [
            f"rank {rank} done" for rank in range(4)
        ], stdout


def _use_library_groups():
    """Build a mesh whose groups the library creates, run collectives, then let the worker stop."""
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(10.0)
    x = distribute_tensor(full, mesh, [Shard(0)])
    one_rank = mesh_module.DeviceMesh("cpu", [dist.get_rank()])  # a one-rank group, made on demand
    one_rank.get_group()
    return torch.equal(x.full_tensor(), full), len(mesh_module._created_groups)


def _release_and_report():
    """The library's groups are destroyed; the default group, which the launcher made, is kept."""
    created = list(mesh_module._created_groups)
    mesh_module.release_process_groups()
    registered = dist.distributed_c10d._world.pg_map
    return [group in registered for group in created], dist.is_initialized(), mesh_module._created_groups


def test_spawned_workers_exit_zero_and_release_only_the_library_groups():
    workers = launch.LocalWorkers(2, timeout=60.0)
    try:
        assert workers.run(_use_library_groups) == [(True, 1), (True, 1)]
        assert workers.run(_release_and_report) == [([False], True, [])] * 2
        assert workers.run(_use_library_groups) == [(True, 1), (True, 1)]  # groups come back on demand
    finally:
        exit_codes = workers.close()
    assert exit_codes == [0, 0]
