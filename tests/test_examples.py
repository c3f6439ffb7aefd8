"""The README's demos, run as test bodies on a real 2x2 mesh: they check themselves against one device."""

import sys
from pathlib import Path

from spmd import spmd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import quickstart  # noqa: E402
import train_mlp  # noqa: E402


@spmd(meshes=[(2, 2)], timeout=120)
def test_quickstart(mesh):
    assert quickstart.main().startswith(f"rank {mesh.get_rank()}")


@spmd(meshes=[(2, 2)], timeout=120)
def test_training_on_a_2x2_mesh_matches_one_device(mesh):
    assert "losses" in train_mlp.main()
