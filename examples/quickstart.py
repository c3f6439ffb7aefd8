"""Distribute a tensor over a 2x2 mesh of four local ranks, move it around, and check the numbers.

Run: python examples/quickstart.py   (no launcher needed: the ranks are spawned locally)
"""

import torch

from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from shardtensor.launch import spawn


def main() -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = torch.randn(5, 6)  # 5 rows over 2 ranks: uneven shards, tracked exactly
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    y = x.redistribute(mesh, [Replicate(), Shard(0)])
    z = (y * 2 + 1).relu()
    assert torch.equal(y.full_tensor(), full)
    assert torch.allclose(z.full_tensor(), (full * 2 + 1).relu())
    coordinate = mesh.get_coordinate()
    return f"rank {mesh.get_rank()} at {coordinate}: x local {tuple(x.to_local().shape)}, y local {tuple(y.to_local().shape)}"


if __name__ == "__main__":
    for line in spawn(main, 4):
        print(line)
    print("ok: the 2x2-mesh results equal the single-device computation")
