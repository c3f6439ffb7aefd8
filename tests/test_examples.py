"""The README's demos and examples/, run as test bodies on a real 2x2 mesh: they check themselves against one device."""

import sys
from pathlib import Path

from spmd import spmd

from shardtensor import comm
from shardtensor.mesh import DeviceMesh
from shardtensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import llama3_tp_sp  # noqa: E402
import quickstart  # noqa: E402
import train_mlp  # noqa: E402


@spmd(meshes=[(2, 2)], timeout=120)
def test_quickstart(mesh):
    assert quickstart.main().startswith(f"rank {mesh.get_rank()}")


@spmd(meshes=[(2, 2)], timeout=120)
def test_training_on_a_2x2_mesh_matches_one_device(mesh):
    assert "losses" in train_mlp.main()


@spmd(meshes=[(2, 2)], timeout=240)
def test_llama3_with_tp_sp_and_fully_shard_saved_on_2x2_resumes_on_1x4_like_one_device(mesh):
    assert "then 1x4" in llama3_tp_sp.main()
    # torchtitan's communication for TP + SP, per forward over 4 tp ranks: the embedding reduce-scatters
    # onto the sequence; each block gathers the sequence before attention and the feed forward and
    # reduce-scatters after wo and w2; the head gathers the sequence once.
    tp = DeviceMesh("cpu", mesh.mesh.flatten(), mesh_dim_names=("tp",))
    model = parallelize_module(llama3_tp_sp.make_model(), tp, llama3_tp_sp.tensor_parallel_plan())
    with comm.observe() as records:
        model(llama3_tp_sp.make_batches()[0][0])
    layers = llama3_tp_sp.ModelArgs.n_layers
    expected = ["reduce_scatter"] * (1 + 2 * layers) + ["all_gather"] * (2 * layers + 1)
    assert sorted(record.kind for record in records) == sorted(expected)


@spmd(meshes=[(2, 2)], timeout=240)
def test_hugging_face_llama_example_matches_one_device(mesh):
    import hf_llama  # imports transformers: only the ranks that run it pay for that, once

    assert "ops without a sharding rule: none" in hf_llama.main()
