"""The domain-parallel U-Net example at a small size on a real 2x2 mesh: it checks itself against one
device (output, input and parameter gradients) and that the field moves by halo exchange only."""

import sys
from pathlib import Path

from spmd import spmd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import unet_domain_parallel  # noqa: E402


@spmd(meshes=[(2, 2)], timeout=180)
def test_unet_on_a_2x2_split_field_matches_one_device(mesh):
    report = unet_domain_parallel.main(size=64)
    assert report.startswith(f"rank {mesh.get_rank()}") and "all_gather" not in report and "all_to_all" not in report
