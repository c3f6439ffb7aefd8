"""A representative slice of PyTorch's OpInfo database on DTensors (the full sweep: tools/opinfo_sweep.py).

Every op in the slice must give the single-device result, forward and backward, on a 1-D mesh of
4 and on 2x2, natively sharded unless EXPECTED_FALLBACK names it (with the reason), or be refused up
front with a clear error on every rank where EXPECTED_REFUSED says so (no hang);
EXPECTED_FAILURES lists the exceptions with a reason each, and an expected failure that starts
passing fails the test so that the list only shrinks.
"""

import pathlib
import sys
from types import SimpleNamespace

import pytest
import torch
from spmd import spmd

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import opinfo_sweep  # noqa: E402

SLICE = {
    "pointwise": ["add", "mul", "div.no_rounding_mode", "exp", "pow", "where", "addcmul", "special.chebyshev_polynomial_t",
                  "ldexp"],
    "reductions": ["sum", "mean", "amax", "argmax", "max.reduction_with_dim", "var", "logsumexp", "cumsum", "aminmax",
                   "median", "equal", "masked.var", "masked.std"],
    "matrix": ["mm", "bmm", "addmm", "matmul", "einsum", "nn.functional.linear", "addmv", "kron"],
    "linalg": ["linalg.solve", "linalg.cholesky", "linalg.svd", "linalg.lu_solve", "linalg.matrix_rank"],
    "views": ["view", "reshape", "transpose", "permute", "expand", "cat", "split", "select", "view_copy", "diag_embed",
              "nn.functional.pad.constant", "rot90", "item", "tensor_split"],
    "indexing": ["index_select", "gather", "masked_fill", "__getitem__", "topk", "index_reduce.amax", "searchsorted"],
    "nn": ["softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.gelu", "nn.functional.embedding",
           "nn.functional.cross_entropy", "nn.functional.max_pool2d", "nn.functional.interpolate.bilinear",
           "nn.functional.grid_sample", "nn.functional.binary_cross_entropy", "nn.functional.scaled_dot_product_attention",
           "nn.functional.linear_cross_entropy.chunked_none"],
    "fft": ["fft.hfft2", "fft.irfftn", "view_as_complex", "stft"],
    "refused": ["sparse.sampled_addmm", "sparse.mm.reduce"],
}
KEYS = [key for family in SLICE.values() for key in family]
# Samples per op: the first few cover the common shapes; the full sweep uses more.
MAX_SAMPLES = 2

# op key -> why it takes the replicate fallback (every other key in SLICE must be natively sharded).
EXPECTED_FALLBACK: dict[str, str] = {
    "nn.functional.linear_cross_entropy.chunked_none": "a custom op (torch_nn._linear_cross_entropy_batch_chunked_no_reduction) "
    "and its backward's mm.out/addmm.out into plain scratch buffers; kept for its gradient, which was silently wrong",
}

# op key -> why the library refuses its inputs up front (status "refused": the same clear error on every rank).
EXPECTED_REFUSED: dict[str, str] = {
    "sparse.sampled_addmm": "sparse CSR inputs: distribute_tensor takes dense strided tensors only (to_dense() first)",
    "sparse.mm.reduce": "sparse CSR inputs: distribute_tensor takes dense strided tensors only (to_dense() first)",
}

# (op key, mesh shape) -> why it fails today (a core bug or a missing piece, not a flaky comparison).
EXPECTED_FAILURES: dict[tuple[str, tuple[int, ...]], str] = {}


@pytest.mark.parametrize("key", KEYS)
@spmd(meshes=[(4,), (2, 2)])
def test_opinfo_slice_matches_single_device(mesh, key):
    result = opinfo_sweep.check_op("shardtensor", mesh, key, MAX_SAMPLES)
    assert result.status != "skipped", f"{key} is not comparable here ({result.reason}): take it out of SLICE"
    expected_failure = EXPECTED_FAILURES.get((key, tuple(mesh.shape)))
    if expected_failure:
        assert result.status == "failing", (
            f"{key} on mesh {tuple(mesh.shape)} now passes ({result.status}); remove it from "
            f"EXPECTED_FAILURES (it was listed because: {expected_failure})"
        )
    elif key in EXPECTED_REFUSED:
        assert result.status == "refused", f"{key} on mesh {tuple(mesh.shape)}: {result.status} {result.reason}"
        assert "distribute_tensor raised TypeError" in result.reason, result.reason
    elif key in EXPECTED_FALLBACK:
        assert result.status in ("native", "fallback"), f"{key} on mesh {tuple(mesh.shape)}: {result.reason}"
    else:
        assert result.status == "native", f"{key} on mesh {tuple(mesh.shape)}: {result.reason}"


def test_summary_line_counts_each_status():
    results = {
        "a": opinfo_sweep.OpResult("a", "native"),
        "b": opinfo_sweep.OpResult("b", "fallback", "replicate fallback for aten.b.default"),
        "c": opinfo_sweep.OpResult("c", "failing", "output 0: mismatch"),
        "d": opinfo_sweep.OpResult("d", "skipped", "draws random numbers"),
        "e": opinfo_sweep.OpResult("e", "refused", "distribute_tensor raised TypeError: ..."),
    }
    assert opinfo_sweep.summary_line(results) == (
        "ops: 4 total, 1 natively sharded, 1 via fallback, 1 refused up front, 1 failing (1 skipped)"
    )


def test_an_op_tagged_seeded_is_random_only_when_it_draws():
    """torch 2.14 runs the 3-D samples of scaled_dot_product_attention through its CPU flash kernel:
    tagged `nondeterministic_seeded` for a dropout it does not support on CPU, it draws nothing."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    dropout = torch.ops.aten.native_dropout
    assert all(torch.Tag.nondeterministic_seeded in op.default.tags for op in (flash, dropout))
    query = torch.randn(1, 2, 3, 4)
    attention = SimpleNamespace(op=lambda query: flash(query, query, query, 0.0)[0])
    assert not opinfo_sweep._is_random(attention, (query, (), {}))
    assert opinfo_sweep._is_random(SimpleNamespace(op=dropout), (query, (0.5, True), {}))
