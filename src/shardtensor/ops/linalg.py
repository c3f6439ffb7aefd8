"""Sharding rules: batched linear algebra (solve, factorizations, decompositions, inverses).

These ops act on the last one or two dims of each tensor argument (its "core" dims) and
independently along the leading batch dims, which broadcast against each other like pointwise
ops. One table gives the core dims of every tensor argument; the rows for one mesh dim are

    all Replicate                   first, so that replicated operands stay where they are;
    S(batch dim) <- S in each input that spans it, R in one that broadcasts it (size 1 or missing);
    P(sum) <- P(sum) in the right-hand side, R elsewhere, for solves (linear in the right-hand side).

Core dims are never sharded: a factorization needs the whole matrix. Every output's leading dims
are the batch dims; an output left empty by the op's flags (`compute_uv=False`) is Replicate.

Errors that depend on the data must be raised by every rank alike, or the ranks that did not raise
wait forever in their next collective. `_linalg_check_errors` therefore reads a Replicate `info`
(a gather of a few ints), and ops whose kernel checks the data itself (`cholesky`, which torch 2.14
removed, `cholesky_inverse`, any `check_errors=True`) only offer the Replicate row.

`geqrf` and `linalg_lstsq` have no meta kernel in torch, so their output shapes cannot be known
ahead of the data (and `lstsq`'s residuals are empty or not depending on the matrices' rank):
they stay on the replicate fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..placement import Partial, Placement, Replicate, Shard
from ..rules import OpCall, Row, ShardingRule, TensorMeta
from .registry import aten, register_rule

__all__ = ["BatchedLinalgRule"]


# A right-hand side that is a batch of vectors (*, n) or of matrices (*, n, k), as `linalg.solve`
# decides: a vector when it is 1-D, or when it has the shape of A without A's last dim.
VECTOR_OR_MATRIX = "vector or matrix"


def _core_dims(core, meta: TensorMeta, first: TensorMeta) -> int:
    if core != VECTOR_OR_MATRIX:
        return core
    vector = meta.ndim == 1 or (meta.ndim == first.ndim - 1 and meta.shape == first.shape[:-1])
    return 1 if vector else 2


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    ndim = max((len(shape) for shape in shapes), default=0)
    result = [1] * ndim
    for shape in shapes:
        for dim, size in enumerate(shape):
            position = dim + ndim - len(shape)
            result[position] = max(result[position], size)
    return tuple(result)


@dataclass(frozen=True)
class BatchedLinalgRule(ShardingRule):
    """An op batched over leading dims.

    `core`: the core dims of each tensor argument of the op's schema, in schema order (optional
    ones included). `linear_in`: the tensor argument (an index into `core`) the first output is
    linear in, other inputs fixed (the right-hand side of a solve); further outputs are then
    copies of Replicate inputs. `checks_data`: the kernel raises on some values, so only the
    Replicate row is exact.
    """

    core: tuple
    linear_in: int | None = None
    checks_data: bool = False

    @property
    def __name__(self) -> str:
        return f"batched linalg (core dims {self.core})"

    def rows(self, call: OpCall) -> Sequence[Row]:
        replicate = Replicate()
        outputs = [meta for meta in call.global_output_metas() if meta is not None]
        rows = [Row((replicate,) * len(outputs), (replicate,) * len(call.inputs))]
        if self.checks_data or call.argument("check_errors"):
            return rows  # an error raised on some ranks only would leave the others hanging
        present = self._present_arguments(call)
        batch_shapes = [meta.shape[: meta.ndim - _core_dims(core, meta, call.inputs[0])] for _, core, meta in present]
        batch_shape = _broadcast(batch_shapes)
        for dim in range(len(batch_shape)):
            inputs = []
            for input_batch in batch_shapes:
                input_dim = dim - (len(batch_shape) - len(input_batch))
                spans = input_dim >= 0 and input_batch[input_dim] == batch_shape[dim]
                inputs.append(Shard(input_dim) if spans else replicate)
            placements = [_output_placement(meta, batch_shape, dim) for meta in outputs]
            if None not in placements:
                rows.append(Row(tuple(placements), tuple(inputs)))
        for position, (argument, _, _) in enumerate(present):
            if argument == self.linear_in:  # solve(A, B1 + B2) = solve(A, B1) + solve(A, B2)
                inputs = tuple(Partial("sum") if index == position else replicate for index in range(len(present)))
                rows.append(Row((Partial("sum"),) + (replicate,) * (len(outputs) - 1), inputs))
        return rows

    def _present_arguments(self, call: OpCall) -> list[tuple[int, object, TensorMeta]]:
        """(index into `core`, core dims, meta) of each tensor argument given as a DTensor, in the
        rows' input order."""
        schema = call.op._schema.arguments
        positions = [index for index, argument in enumerate(schema) if "Tensor" in str(argument.type)]
        if len(positions) != len(self.core):
            raise RuntimeError(f"{call.op} has {len(positions)} tensor arguments but its rule names {len(self.core)}")
        present = []
        for argument, (core, index) in enumerate(zip(self.core, positions)):
            value = call.argument(schema[index].name)
            if isinstance(value, TensorMeta):
                present.append((argument, core, value))
        return present


def _output_placement(meta: TensorMeta, batch_shape: tuple[int, ...], dim: int) -> Placement | None:
    if meta.shape[: len(batch_shape)] == batch_shape:
        return Shard(dim)
    if 0 in meta.shape:
        return Replicate()  # an output the op's flags leave empty: the same (0,) tensor on every rank
    return None  # an output without the batch dims: no exact sharded row


def _check_errors(call: OpCall) -> list[Row]:
    """`_linalg_check_errors(info, ...)` raises when an entry of `info` is non-zero: every rank must
    see all of `info` (a few ints) and so raise alike, naming the same batch element."""
    return [Row((), (Replicate(),))]


_MATRIX, _VECTOR, _SCALAR = 2, 1, 0

# op -> rule. `linear_in` is the right-hand side of the solves.
_BATCHED = {
    aten.linalg_solve_triangular.default: BatchedLinalgRule((_MATRIX, _MATRIX), linear_in=1),
    aten.linalg_lu_solve.default: BatchedLinalgRule((_MATRIX, _VECTOR, _MATRIX), linear_in=2),
    aten.linalg_lu.default: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_lu_factor_ex.default: BatchedLinalgRule((_MATRIX,)),
    aten.lu_unpack.default: BatchedLinalgRule((_MATRIX, _VECTOR)),
    aten.linalg_inv_ex.default: BatchedLinalgRule((_MATRIX,)),
    aten._linalg_solve_ex.default: BatchedLinalgRule((_MATRIX, VECTOR_OR_MATRIX)),
    aten.linalg_cholesky_ex.default: BatchedLinalgRule((_MATRIX,)),
    aten.cholesky.default: BatchedLinalgRule((_MATRIX,), checks_data=True),
    aten.cholesky_inverse.default: BatchedLinalgRule((_MATRIX,), checks_data=True),
    aten.cholesky_solve.default: BatchedLinalgRule((_MATRIX, _MATRIX), linear_in=0),
    aten._cholesky_solve_helper.default: BatchedLinalgRule((_MATRIX, _MATRIX), linear_in=0),
    aten.triangular_solve.default: BatchedLinalgRule((_MATRIX, _MATRIX), linear_in=0),
    aten.linalg_eig.default: BatchedLinalgRule((_MATRIX,)),
    aten._linalg_eigh.default: BatchedLinalgRule((_MATRIX,)),
    aten._linalg_svd.default: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_pinv.default: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_pinv.atol_rtol_float: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_pinv.atol_rtol_tensor: BatchedLinalgRule((_MATRIX, _SCALAR, _SCALAR)),
    aten.linalg_pinv.rcond_tensor: BatchedLinalgRule((_MATRIX, _SCALAR)),
    aten._linalg_det.default: BatchedLinalgRule((_MATRIX,)),
    aten._linalg_slogdet.default: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_ldl_factor_ex.default: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_ldl_solve.default: BatchedLinalgRule((_MATRIX, _VECTOR, _MATRIX), linear_in=2),
    aten.linalg_matrix_exp.default: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_qr.default: BatchedLinalgRule((_MATRIX,)),
    aten.linalg_householder_product.default: BatchedLinalgRule((_MATRIX, _VECTOR)),
    aten.ormqr.default: BatchedLinalgRule((_MATRIX, _VECTOR, _MATRIX), linear_in=2),
}

for _op, _rule in _BATCHED.items():
    register_rule([_op], _rule)
register_rule([aten._linalg_check_errors.default], _check_errors)
