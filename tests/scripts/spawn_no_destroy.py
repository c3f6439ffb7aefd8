"""Run as a program: two local ranks spawned by `shardtensor.launch.spawn` use a 2-rank mesh and
one-rank groups, and nobody destroys a process group by hand; the program and its workers must exit
with code 0, with no abort and no leaked-semaphore warning on stderr."""

import torch

from shardtensor import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh, launch


def body():
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(10.0)
    x = distribute_tensor(full, mesh, [Shard(0)])
    DeviceMesh("cpu", [mesh.get_rank()]).get_group()  # a one-rank group the library creates
    return torch.equal(x.redistribute(mesh, [Replicate()]).to_local(), full)


if __name__ == "__main__":
    print("results", launch.spawn(body, 2))
