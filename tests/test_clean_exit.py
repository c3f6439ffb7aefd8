"""Programs exit with code 0 without calling destroy_process_group: under torchrun and under spawn.

c10d's destroy_process_group does not stop a gloo group's worker threads; only freeing the group
does. A worker thread still alive while Python finalizes, dropping the last collective's tensors,
needs the interpreter and aborts the rank ("terminate called without an active exception", exit code
-6; about 1 torchrun job in 2 on a loaded machine before the fix). The library destroys what it
created at exit and holds no other reference to a group (meshes name groups by rank set), so the
groups are freed and their threads joined before finalization (`process_groups.release_process_groups`).
Each program also checks the cause directly: no gloo worker thread outlives the exit handler. That
holds too for a program that makes and destroys the default group itself while the library creates
no group (the demo on a 1x2 mesh): the library's caches hold the program's groups, so its exit
handler is registered as soon as it holds one, not only when it creates one.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import SMALL_DEMO_FLAGS, gloo_worker_threads

from shardtensor import DeviceMesh, Shard, distribute_tensor, init_device_mesh, launch, process_groups

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]  # then the ranks
ROUNDS, JOBS = 2, 3  # 6 jobs, 3 at a time: an abort in 1 job of 2 passes all 6 with probability 1/64
DEMO_JOBS = 2  # the demo aborted in ~1 job of 5-10 before the fix, but its gloo-thread check failed in every job


def _run_together(command: list[str], jobs: int) -> list[tuple[int, str, str]]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
               for _ in range(jobs)]
    outputs = [job.communicate(timeout=300) for job in running]
    return [(job.returncode, *output) for job, output in zip(running, outputs)]


def test_torchrun_jobs_without_destroy_process_group_all_exit_zero():
    for round_index in range(ROUNDS):
        for job, (code, stdout, stderr) in enumerate(_run_together([*TORCHRUN, "4", str(SCRIPTS / "torchrun_no_destroy.py")], JOBS)):
            where = f"round {round_index}, torchrun job {job} of {JOBS}"
            assert code == 0, f"{where} exited with {code}:\n{stdout[-2000:]}\n{stderr[-3000:]}"
            assert sorted(re.findall(r"rank (\d+) done", stdout)) == ["0", "1", "2", "3"], stdout  # ranks' lines may interleave


def test_the_demo_under_torchrun_exits_zero_every_time_and_leaves_no_gloo_worker(tmp_path):
    """fully_shard x tensor parallel on a 1x2 mesh, the default group made and destroyed by the demo."""
    text = tmp_path / "text.txt"
    text.write_text("abcdefgh\n" * 100)
    command = [*TORCHRUN, "2", str(SCRIPTS / "torchrun_demo.py"), *SMALL_DEMO_FLAGS, "--data", str(text)]
    for job, (code, stdout, stderr) in enumerate(_run_together(command, DEMO_JOBS)):
        assert code == 0, f"demo torchrun job {job} of {DEMO_JOBS} exited with {code}:\n{stdout[-2000:]}\n{stderr[-3000:]}"
        assert "mesh 1x2" in stdout and "fully_shard on dp" in " ".join(stdout.split()), stdout


def test_spawned_programs_exit_zero_without_aborts_or_leaked_semaphores():
    for job, (code, stdout, stderr) in enumerate(_run_together([sys.executable, str(SCRIPTS / "spawn_no_destroy.py")], 2)):
        assert code == 0, f"spawn program {job} exited with {code}:\n{stdout[-2000:]}\n{stderr[-3000:]}"
        assert "results [True, True]" in stdout, stdout
        for sign in ("terminate called", "leaked semaphore", "exited with"):
            assert sign not in stderr, stderr[-3000:]


def _use_library_groups():
    """Build a mesh whose groups the library creates, run collectives, then let the worker stop."""
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(10.0)
    x = distribute_tensor(full, mesh, [Shard(0)])
    one_rank = DeviceMesh("cpu", [dist.get_rank()])  # a one-rank group, made on demand
    one_rank.get_group()
    return torch.equal(x.full_tensor(), full), len(process_groups._created_groups), gloo_worker_threads()


def _release_and_report():
    """The library's groups are destroyed and freed (their threads joined, although this rank still
    holds a mesh, a sub-mesh group and a DTensor over them); the default group, which the launcher
    made, is kept; a mesh built before the release raises a clear error when used."""
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    one_rank = DeviceMesh("cpu", [dist.get_rank()])
    one_rank.get_group()
    created = [group.group_name for group in process_groups._created_groups]  # names: holding a group keeps it alive
    process_groups.release_process_groups()
    registered = set(dist.distributed_c10d._world.pg_names.values())
    with pytest.raises(RuntimeError, match="belongs to a process-group world that was destroyed"):
        one_rank.get_group()
    with pytest.raises(RuntimeError, match="belongs to a process-group world that was destroyed"):
        x.full_tensor()
    return [group in registered for group in created], dist.is_initialized(), process_groups._created_groups, gloo_worker_threads()


def test_spawned_workers_exit_zero_and_release_only_the_library_groups():
    workers = launch.LocalWorkers(2, timeout=60.0)
    try:
        world_threads = workers.run(gloo_worker_threads)[0]  # the launcher's default group only
        used = workers.run(_use_library_groups)
        assert [result[:2] for result in used] == [(True, 1), (True, 1)]
        assert all(threads > world_threads for _, _, threads in used)  # the one-rank group has its own
        assert workers.run(_release_and_report) == [([False], True, [], world_threads)] * 2
        assert [result[:2] for result in workers.run(_use_library_groups)] == [(True, 1), (True, 1)]  # back on demand
    finally:
        exit_codes = workers.close(timeout=60.0)  # a worker takes ~5 s to exit (on main too), more when loaded
    assert exit_codes == [0, 0]
