"""Run under torchrun with 4 ranks: a 2x2 mesh, a redistribute and a full_tensor, and no
destroy_process_group at the end; the process must still exit with code 0 (the library tears down
the process groups it created at interpreter exit).

The abort this guards against is a race (a gloo worker thread dropping the last collective's tensors
while Python finalizes), so the script also checks its cause, which is not a race: once the library's
exit handler has run, no gloo worker thread is left. atexit runs handlers last-in first-out, so the
check, registered before the library registers its handler, runs after it; it exits with code 3.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
from helpers import exit_3_if_gloo_workers_outlive_the_library  # noqa: E402

from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh  # noqa: E402

exit_3_if_gloo_workers_outlive_the_library()

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
full = torch.arange(40.0).reshape(10, 4)
x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
y = x.redistribute(mesh, [Replicate(), Shard(0)])
assert torch.equal(y.full_tensor(), full)
assert torch.equal(x.full_tensor(), full)
print(f"rank {mesh.get_rank()} done")
