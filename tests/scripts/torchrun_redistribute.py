"""Run under torchrun: the mesh picks up the launcher's environment (env://)."""

import torch

from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh

mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
full = torch.arange(10.0).reshape(5, 2)
x = distribute_tensor(full, mesh, [Shard(0)])
assert torch.equal(x.redistribute(mesh, [Replicate()]).to_local(), full)
print(f"rank {mesh.get_rank()} holds {tuple(x.to_local().shape)}")
