"""Run under torchrun with 4 ranks: a 2x2 mesh, a redistribute and a full_tensor, and no
destroy_process_group at the end; the process must still exit with code 0 (the library tears down
the process groups it created at interpreter exit)."""

import torch

from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
full = torch.arange(40.0).reshape(10, 4)
x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
y = x.redistribute(mesh, [Replicate(), Shard(0)])
assert torch.equal(y.full_tensor(), full)
assert torch.equal(x.full_tensor(), full)
print(f"rank {mesh.get_rank()} done")
