"""Train a two-layer MLP on a 2x2 mesh of local ranks (data parallel x tensor parallel).

The batch is sharded over the "dp" mesh dim; the first layer's weight is split by output features
and the second layer's by input features over "tp" (Megatron-style). Every rank also trains the
same model on one device, and the script checks that both give the same losses and weights.

Run: python examples/train_mlp.py   (no launcher needed: four ranks are spawned locally)
"""

import torch

from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from shardtensor.dispatch import fallback_counts
from shardtensor.launch import spawn

STEPS = 5
LEARNING_RATE = 0.1


def make_model_and_data():
    torch.manual_seed(0)
    weights = {
        "w1": torch.randn(32, 16) * 0.2, "b1": torch.zeros(32),
        "w2": torch.randn(4, 32) * 0.2, "b2": torch.zeros(4),
    }
    inputs, targets = torch.randn(10, 16), torch.randn(10, 4)
    return weights, inputs, targets


def train(weights, inputs, targets):
    """Plain SGD on whatever tensors it is given: torch tensors or DTensors, same code."""
    for name in weights:
        weights[name].requires_grad_(True)
    losses = []
    for _ in range(STEPS):
        hidden = torch.relu(inputs @ weights["w1"].T + weights["b1"])
        prediction = hidden @ weights["w2"].T + weights["b2"]
        loss = ((prediction - targets) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for weight in weights.values():
                weight -= LEARNING_RATE * weight.grad
                weight.grad = None
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return losses


def main() -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    weights, inputs, targets = make_model_and_data()
    placements = {
        "w1": [Replicate(), Shard(0)], "b1": [Replicate(), Shard(0)],
        "w2": [Replicate(), Shard(1)], "b2": [Replicate(), Replicate()],
    }
    sharded = {name: distribute_tensor(weights[name], mesh, placements[name]) for name in weights}
    batch = [Shard(0), Replicate()]
    losses = train(sharded, distribute_tensor(inputs, mesh, batch), distribute_tensor(targets, mesh, batch))
    reference = {name: weight.clone() for name, weight in weights.items()}
    reference_losses = train(reference, inputs, targets)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses))
    for name, weight in sharded.items():
        torch.testing.assert_close(weight.detach().full_tensor(), reference[name].detach())
    fallbacks = ", ".join(sorted(fallback_counts)) or "none"
    return f"rank {mesh.get_rank()}: losses {[round(loss, 4) for loss in losses]}; ops without a sharding rule: {fallbacks}"


if __name__ == "__main__":
    for line in spawn(main, 4):
        print(line)
    print("ok: training on the 2x2 mesh gives the single-device losses and weights")
