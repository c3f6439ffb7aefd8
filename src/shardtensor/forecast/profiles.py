"""Hardware profiles: the planner's alpha-beta `CostModel` for each link class (within a node, across nodes).

A collective whose group stays inside one node runs at the intra-node link's latency and bandwidth,
any other at the inter-node link's; both are priced by `CostModel.step_cost(kind, bytes received)`, the
function the redistribute planner prices its steps with (one cost model for plans and forecasts).
Bandwidths are per rank and per direction, in bytes per microsecond (1 GB/s = 1,000 bytes/us).
Sources of the published figures are in docs/forecast.md.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from dataclasses import dataclass

from ..redistribute.planner import CostModel

__all__ = ["HardwareProfile", "PROFILES", "profile_named", "calibrated_profile", "cost_model", "CALIBRATION_FILE"]

CALIBRATION_FILE = pathlib.Path(__file__).with_name("calibrated_gloo.json")
INTRA_NODE, INTER_NODE = "intra_node", "inter_node"


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A cluster's ranks per node and the cost model of each link class."""

    name: str
    ranks_per_node: int
    intra_node: CostModel
    inter_node: CostModel
    source: str

    def link(self, link_class: str) -> CostModel:
        return self.intra_node if link_class == INTRA_NODE else self.inter_node

    def with_ranks_per_node(self, ranks_per_node: int) -> HardwareProfile:
        return HardwareProfile(self.name, ranks_per_node, self.intra_node, self.inter_node, self.source)


def _link(latency_us: float, gigabytes_per_second: float) -> CostModel:
    return CostModel(latency_us=latency_us, exchange_latency_us=3 * latency_us, bytes_per_us=gigabytes_per_second * 1000.0)


# Published per-GPU link bandwidths, one direction; latencies are typical small-message NCCL figures
# (an assumption, see docs/forecast.md).
PROFILES = {
    "dgx-h100": HardwareProfile(
        "dgx-h100", 8, intra_node=_link(8.0, 450.0), inter_node=_link(15.0, 50.0),
        source="NVIDIA DGX H100: NVLink 4 at 900 GB/s per GPU (450 GB/s each way); one ConnectX-7 NDR "
               "InfiniBand port of 400 Gb/s (50 GB/s) per GPU",
    ),
    "dgx-a100": HardwareProfile(
        "dgx-a100", 8, intra_node=_link(10.0, 300.0), inter_node=_link(20.0, 25.0),
        source="NVIDIA DGX A100: NVLink 3 at 600 GB/s per GPU (300 GB/s each way); one ConnectX-6 HDR "
               "InfiniBand port of 200 Gb/s (25 GB/s) per GPU",
    ),
}


def cost_model(latencies: dict[str, float], bytes_per_us: float) -> CostModel:
    """The `CostModel` of a calibration (`calibrate.fit`): every measured kind's own latency, the all_reduce
    one as the default, the slowest one for the planner's whole-mesh exchange."""
    default = latencies.get("all_reduce", statistics.median(latencies.values()))
    return CostModel(latency_us=default, exchange_latency_us=max(latencies.values()), bytes_per_us=bytes_per_us,
                     latency_by_kind=tuple(sorted(latencies.items())))


def calibrated_profile(path: pathlib.Path = CALIBRATION_FILE) -> HardwareProfile:
    """This machine's gloo over loopback, as measured by `python -m shardtensor.forecast.calibrate`.

    Every local rank shares one node, so both link classes are the measured one.
    """
    measured = json.loads(path.read_text())
    link = cost_model(measured["latency_by_kind_us"], measured["bytes_per_us"])
    source = f"measured with gloo on {measured['ranks']} local ranks on {measured['date']} ({measured['machine']})"
    return HardwareProfile("gloo-local", measured["ranks_per_node"], intra_node=link, inter_node=link, source=source)


def profile_named(name: str) -> HardwareProfile:
    """A published profile by name, or "gloo-local" for this machine's calibration."""
    if name == "gloo-local":
        return calibrated_profile()
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of {sorted(PROFILES) + ['gloo-local']}")
    return PROFILES[name]
