"""The same program under torchrun (env:// rendezvous) and in a plain single process."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_redistribute.py"


def test_torchrun_two_processes():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "rank 0 holds (3, 2)" in finished.stdout and "rank 1 holds (2, 2)" in finished.stdout


def test_plain_process_is_a_world_of_one():
    code = (
        "import torch; from shardtensor import init_device_mesh, distribute_tensor, Shard;"
        "mesh = init_device_mesh('cpu', (1,));"
        "x = distribute_tensor(torch.arange(3.0), mesh, [Shard(0)]);"
        "assert torch.equal(x.full_tensor(), torch.arange(3.0)); print('ok')"
    )
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.strip() == "ok"
