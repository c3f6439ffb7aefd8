"""API parity with PyTorch: the torch names shardtensor lacks are exactly the ones listed here, each with its
reason, so that a regression (a name we lost) or a new torch name (after an upgrade) fails this test.

The names come from `tools/api_parity.py` (run it to see them); an entry is removed when the name is
implemented, and added only with a reason a reader accepts. A name that only some supported torch versions
have goes in `ALLOWED_MISSING_SINCE` under the first version that has it.
"""

import importlib.util
import pathlib

import torch

_FSDP1 = "FSDP1 (FullyShardedDataParallel) and its configuration: shardtensor implements FSDP2 (fully_shard) only"
_CUDA_ONLY = "CUDA streams, events or NCCL memory: this library runs collectives through comm without managing streams"

ALLOWED_MISSING = {
    # --- device mesh ------------------------------------------------------------------------------------
    "torch.distributed.device_mesh.init_device_mesh(backend_override)":
        "the backend follows the device type (gloo for cpu, nccl for cuda); per-mesh-dim backend overrides are not supported",
    # --- FSDP2 -------------------------------------------------------------------------------------------
    "torch.distributed.fsdp.DataParallelMeshDims":
        "fully_shard over an SPMD mesh whose parameters are already DTensors on it: large, use a dp sub-mesh instead",
    "torch.distributed.fsdp.fully_shard(dp_mesh_dims)": "see DataParallelMeshDims",
    "torch.distributed.fsdp.FSDPModule.set_custom_all_gather":
        "takes torch's internal AllGather protocol (allocation and stream hooks); units gather through comm",
    "torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter":
        "takes torch's internal ReduceScatter protocol (allocation and stream hooks); units reduce through comm",
    "torch.distributed.fsdp.FSDPModule.set_allocate_memory_from_process_group_for_comm": _CUDA_ONLY,
    "torch.distributed.fsdp.FSDPModule.set_symm_mem_for_comm": _CUDA_ONLY,
    "torch.distributed.fsdp.FSDPModule.set_post_optim_event": _CUDA_ONLY,
    "torch.distributed.fsdp.FSDPModule.set_reduce_scatter_max_input_buffers": _CUDA_ONLY,
    "torch.distributed.fsdp.FSDPModule.set_separate_reduce_scatter_group":
        "a second process group so that reduce-scatters overlap on their own CUDA stream: " + _CUDA_ONLY,
    "torch.distributed.fsdp.share_comm_ctx": _CUDA_ONLY,
    **{f"torch.distributed.fsdp.{name}": _FSDP1 for name in (
        "BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel",
        "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision", "OptimStateDictConfig",
        "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
        "StateDictConfig", "StateDictSettings", "StateDictType")},
    # --- DTensor and placements ----------------------------------------------------------------------------
}

# torch version (major, minor) -> the names it adds that shardtensor lacks, with their reasons. torch 2.14 also
# adds the factories `linspace` and `logspace`, and 2.15 `FSDPModule.set_keep_unsharded_storage`, which
# shardtensor has (on every torch version).
ALLOWED_MISSING_SINCE = {
    (2, 14): {
        "torch.distributed.tensor.experimental.local_map(spmd_types)":
            "annotates the local tensors for the type checker of the separate `spmd_types` package and runs it; "
            "shardtensor has no such checker integration",
    },
    (2, 15): {
        "torch.distributed.device_mesh.DeviceMesh.abort":
            "aborts the root mesh's process groups when a rank died (NCCL fault recovery); shardtensor's groups are "
            "shared per rank set by every mesh of the world (process_groups), so it has no per-mesh abort; "
            "torch.distributed.destroy_process_group ends them all",
        "torch.distributed.fsdp.FSDPModule.set_manual_backward_finalization":
            "defers the end of backward (reduce-scatter waits, resharding) to finalize_backward, for pipeline "
            "schedules that reduce gradients as a separate action; here every backward finishes its reductions "
            "and reshards in the end-of-backward callback (as set_is_last_backward(True) does), with no manual mode",
        "torch.distributed.fsdp.FSDPModule.finalize_backward": "see set_manual_backward_finalization",
        "torch.distributed.fsdp.GradientReductionHandle": "finalize_backward(async_op=True)'s handle: see "
            "set_manual_backward_finalization",
        "torch.distributed.fsdp.MixedPrecisionPolicy.param_dtype_override_fn":
            "keeps some parameters in their own dtype while the others are gathered in param_dtype; a unit here "
            "gathers one flat buffer of one dtype: shard such parameters in their own fully_shard call",
    },
}


def allowed_missing(torch_version: str = torch.__version__) -> dict[str, str]:
    """The names shardtensor may lack on this torch version, with their reasons."""
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    allowed = dict(ALLOWED_MISSING)
    for version, names in ALLOWED_MISSING_SINCE.items():
        if (major, minor) >= version:
            allowed.update(names)
    return allowed


def _api_parity():
    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "api_parity.py"
    spec = importlib.util.spec_from_file_location("api_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_torch_names_are_exactly_the_allowed_ones():
    missing = set(_api_parity().missing_names())
    allowed = allowed_missing()
    lost = sorted(missing - set(allowed))
    implemented = sorted(set(allowed) - missing)
    assert not lost, f"torch names shardtensor lacks that are not allowed (implement, or allow with a reason): {lost}"
    assert not implemented, (
        f"allowed names that are no longer missing (remove them from ALLOWED_MISSING or ALLOWED_MISSING_SINCE): {implemented}")


def test_the_tool_sees_members_and_parameters():
    """The tool itself: a member or a parameter torch has and ours lacks is reported."""
    api_parity = _api_parity()

    class Theirs:
        def method(self, x, *, extra=None):
            return x

        def other(self):
            return None

    class Ours:
        def method(self, x):
            return x

    Theirs.__module__ = "torch.distributed.fake"
    assert api_parity.class_members(Theirs) == {"method", "other"}
    assert api_parity.missing_parameters(Theirs.method, Ours.method) == ["extra"]
    assert api_parity.missing_parameters(Theirs.method, lambda self, x, **kwargs: x) == []


def test_names_a_newer_torch_adds_are_allowed_from_that_version_on():
    spmd_types = "torch.distributed.tensor.experimental.local_map(spmd_types)"
    assert spmd_types not in allowed_missing("2.13.0+cpu")
    assert spmd_types in allowed_missing("2.14.1+cu130") and spmd_types in allowed_missing("2.15.0")
    assert set(ALLOWED_MISSING) <= set(allowed_missing("2.13.0"))
