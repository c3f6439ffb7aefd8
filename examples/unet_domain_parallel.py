"""A small U-Net on one 512x512 field split 2x2 over four local ranks (domain parallelism).

The field (batch 1, one channel) is sharded along H over mesh dim 0 and along W over mesh dim 1 with
uneven shard sizes (288 + 224 rows, 192 + 320 columns: multiples of 4, so the two poolings and the
two upsamplings keep every level's pieces aligned with its skip connection). The model is plain
torch: 3x3 convolutions, batch norm (training), group norm, instance norm, ReLU, max and average
pooling down, a transposed convolution and bilinear interpolation up, skip concatenations. Its
parameters are replicated (`distribute_module`); every op on the sharded field exchanges only halo
rows with its mesh neighbours, and the norms reduce their statistics in one all_reduce each.

Each rank also runs the same model on the whole field on one device, checks that the output, the
input gradient and every parameter gradient match, and prints the bytes it received in the step
next to what gathering each spatial op's input (and, in backward, its output gradient) would move.

Run: python examples/unet_domain_parallel.py [--size 512]   (four ranks are spawned locally)
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from shardtensor import DTensor, Shard, distribute_module, init_device_mesh
from shardtensor.debug import CommDebugMode
from shardtensor.launch import spawn
from shardtensor.layout import Layout

# Shard sizes per mesh dim, as fractions of the side: 9/16 + 7/16 rows, 6/16 + 10/16 columns.
ROW_SIXTEENTHS, COLUMN_SIXTEENTHS = (9, 7), (6, 10)
HALO_KINDS = ("batch_p2p", "send", "recv")


def convolution_block(inputs: int, outputs: int, norm: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), norm, nn.ReLU())


class UNet(nn.Module):
    """Two levels down (max pool, average pool), two up (transposed convolution, bilinear)."""

    def __init__(self, channels: int = 8):
        super().__init__()
        wide = 2 * channels
        self.encoder1 = convolution_block(1, channels, nn.BatchNorm2d(channels))
        self.encoder2 = convolution_block(channels, wide, nn.GroupNorm(4, wide))
        self.bottom = convolution_block(wide, wide, nn.InstanceNorm2d(wide, affine=True))
        self.up2 = nn.ConvTranspose2d(wide, wide, 2, stride=2)
        self.decoder2 = convolution_block(2 * wide, channels, nn.GroupNorm(2, channels))
        self.decoder1 = convolution_block(2 * channels, channels, nn.BatchNorm2d(channels))
        self.head = nn.Conv2d(channels, 1, 1)
        self.max_pool, self.average_pool = nn.MaxPool2d(2), nn.AvgPool2d(2)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)

    def forward(self, field: torch.Tensor) -> torch.Tensor:
        skip1 = self.encoder1(field)
        skip2 = self.encoder2(self.max_pool(skip1))
        bottom = self.bottom(self.average_pool(skip2))
        up2 = self.decoder2(torch.cat([self.up2(bottom), skip2], dim=1))
        up1 = self.up1(up2)
        return self.head(self.decoder1(torch.cat([up1, skip1], dim=1)))


def spatial_inputs(model: UNet, field: torch.Tensor) -> list[torch.Size]:
    """Shapes of the tensors each spatial op (convolution wider than 1x1, pooling, upsampling)
    reads, from a forward on one device: what a gather-based implementation would gather."""
    shapes = []
    spatial = [module for module in model.modules()
               if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.Upsample))
               and getattr(module, "kernel_size", None) not in ((1, 1), 1)]
    hooks = [module.register_forward_pre_hook(lambda module, inputs: shapes.append(inputs[0].shape))
             for module in spatial]
    with torch.no_grad():
        model(field)
    for hook in hooks:
        hook.remove()
    return shapes


def gathered_bytes(shapes: list[torch.Size], local_fraction: float, itemsize: int) -> int:
    """Bytes one rank receives if every spatial op all_gathered its input in forward and its output
    gradient (about as large) in backward: the field minus the rank's own piece, twice."""
    return round(2 * sum(shape.numel() for shape in shapes) * itemsize * (1 - local_fraction))


def sharded_field(full: torch.Tensor, mesh) -> DTensor:
    """`full` split along H over mesh dim 0 and along W over mesh dim 1 with the uneven sizes."""
    side_rows, side_columns = full.shape[2], full.shape[3]
    shard_sizes = {0: [side_rows * part // 16 for part in ROW_SIXTEENTHS],
                   1: [side_columns * part // 16 for part in COLUMN_SIXTEENTHS]}
    placements = [Shard(2), Shard(3)]
    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=shard_sizes)
    coordinate = mesh.get_coordinate()
    local = full
    for dim, (start, length) in enumerate(zip(layout.local_offset(coordinate), layout.local_shape(coordinate))):
        local = local.narrow(dim, start, length)
    return DTensor.from_local(local.clone(), mesh, placements, shape=full.shape, shard_sizes=shard_sizes)


def main(size: int = 512) -> str:
    """Run one training step sharded and on one device; return this rank's report (raise on mismatch)."""
    if size % 64:
        raise ValueError(f"--size {size}: give a multiple of 64, so every level's uneven pieces stay aligned")
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model = UNet()
    reference = copy.deepcopy(model)
    distribute_module(model, mesh)
    full = torch.randn(1, 1, size, size)
    target = torch.randn(1, 1, size, size)

    field = sharded_field(full, mesh).requires_grad_()
    target_field = sharded_field(target, mesh)
    with CommDebugMode() as step:
        output = model(field)
        loss = ((output - target_field) ** 2).mean()
        loss.backward()

    reference_field = full.clone().requires_grad_()
    reference_output = reference(reference_field)
    ((reference_output - target) ** 2).mean().backward()

    differences = {"output": (output.full_tensor() - reference_output).abs().max().item(),
                   "input grad": (field.grad.full_tensor() - reference_field.grad).abs().max().item()}
    parameters = dict(reference.named_parameters())
    differences["parameter grads"] = max(
        (parameter.grad.full_tensor() - parameters[name].grad).abs().max().item()
        for name, parameter in model.named_parameters()
    )
    for what, difference in differences.items():
        if difference > 1e-4:
            raise AssertionError(f"rank {mesh.get_rank()}: {what} differ from one device by {difference:.3g}")

    counts = step.get_comm_counts()
    moved_field = {kind for kind in counts if kind in ("all_gather", "all_to_all")}
    if moved_field:
        raise AssertionError(f"rank {mesh.get_rank()}: the step gathered or all_to_all'ed the field: {counts}")
    received = sum(record.bytes_received for record in step.records)
    halo = sum(record.bytes_received for record in step.records if record.kind in HALO_KINDS)
    local_fraction = field.to_local().numel() / full.numel()
    gather = gathered_bytes(spatial_inputs(reference, full), local_fraction, full.element_size())
    return (f"rank {mesh.get_rank()} (local field {tuple(field.to_local().shape[2:])}): max |diff| "
            + ", ".join(f"{what} {difference:.1e}" for what, difference in differences.items())
            + f"; received {received / 1e3:.1f} KB per step ({halo / 1e3:.1f} KB halo) vs "
            f"{gather / 1e3:.1f} KB to gather every spatial op's input; collectives {counts}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="side of the square field (a multiple of 64)")
    arguments = parser.parse_args()
    for line in spawn(main, 4, arguments.size):
        print(line)
    print(f"ok: the U-Net step on the {arguments.size}x{arguments.size} field split 2x2 matches one device")
