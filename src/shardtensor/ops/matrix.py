"""Sharding rules: matrix products (mm, bmm, mv, dot, vdot, addmm, addmv, addr, addbmm, baddbmm),
generated from einsum specs.

`matmul`, `linear`, `einsum`, `inner`, `tensordot`, `kron`, `linalg.multi_dot` and
`linalg.vecdot` (`vdot` for vectors) reach `__torch_dispatch__` as these ops plus views, so these
rules cover them too. One spec gives the rows for one mesh dim:

    every letter kept in the output   S(its output dim) <- S in each operand that has it, R elsewhere
    every contracted letter           P(sum) <- S in each operand that has it, R elsewhere
    linearity in each operand         P(s) <- P(s) in that operand, R elsewhere, s in sum, avg
    and all Replicate first, so that replicated operands stay where they are on a tie.

`addmm`/`addmv`/`addr`/`addbmm`/`baddbmm` add a broadcast addend: it lies like the output, except
that it is Replicate along a dim it broadcasts and Partial when the product is (adding a Replicate addend to a
Partial(sum) product would add it once per rank; the planner makes a Replicate addend Partial locally: for
Partial(avg), whose operands may each hold the addend, without changing it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..placement import Partial, Placement, Replicate, Shard
from ..rules import OpCall, PlainTensor, Row, ShardingRule
from .registry import aten, register_rule

__all__ = ["einsum_rows", "EinsumRule", "AddendEinsumRule", "AddmvRule"]


def einsum_rows(spec: str) -> list[Row]:
    """The rows of an einsum spec along one mesh dim, preferred first.

    >>> [str(row) for row in einsum_rows("k,k->")][1]
    '[P(sum) <- S(0), S(0)]'
    """
    operands_text, output = spec.split("->")
    operands = operands_text.split(",")
    replicate = Replicate()
    rows = [Row((replicate,), (replicate,) * len(operands))]
    for letter in dict.fromkeys(operands_text.replace(",", "")):  # letters in order of appearance
        inputs = tuple(Shard(operand.index(letter)) if letter in operand else replicate for operand in operands)
        produced = Shard(output.index(letter)) if letter in output else Partial("sum")
        rows.append(Row((produced,), inputs))
    for partial in (Partial("sum"), Partial("avg")):  # a product of sums (averages) with R is the sum (average) of products
        for linear_operand in range(len(operands)):
            inputs = tuple(partial if index == linear_operand else replicate for index in range(len(operands)))
            rows.append(Row((partial,), inputs))
    return rows


class EinsumRule(ShardingRule):
    """An op that computes `torch.einsum(spec, *operands)`; its rows do not depend on shapes."""

    def __init__(self, spec: str):
        self.spec = spec
        self.__name__ = f"einsum({spec!r})"
        self._rows = einsum_rows(spec)

    def rows(self, call: OpCall) -> Sequence[Row]:
        return self._rows


class AddendEinsumRule(EinsumRule):
    """`addend * beta + einsum(spec, ...) * alpha`, the addend broadcast to the output (addmm, baddbmm)."""

    def rows(self, call: OpCall) -> Sequence[Row]:
        if isinstance(call.argument("self"), PlainTensor):  # a plain 0-d addend is on every rank: no P(sum) product
            return [row for row in self._rows if row.outputs[0] != Partial("sum")]
        addend, *operands = call.inputs
        output_shape = self._output_shape(operands)
        return [Row(row.outputs, (self._addend_placement(row.outputs[0], addend.shape, output_shape),) + row.inputs)
                for row in self._rows]

    def _output_shape(self, operands) -> tuple[int, ...]:
        operands_text, output = self.spec.split("->")
        sizes = {}
        for letters, meta in zip(operands_text.split(","), operands):
            sizes.update(zip(letters, meta.shape))
        return tuple(sizes[letter] for letter in output)

    @staticmethod
    def _addend_placement(output: Placement, addend_shape, output_shape) -> Placement:
        if not isinstance(output, Shard):
            return output  # Replicate, or Partial: the addend becomes an operand of the sum (average) too
        addend_dim = output.dim - (len(output_shape) - len(addend_shape))
        spans = addend_dim >= 0 and addend_shape[addend_dim] == output_shape[output.dim]
        return Shard(addend_dim) if spans else Replicate()


def _addmv_with_full_addend(mesh, addend, matrix, vector, **kwargs):
    return aten.addmv.default(addend.expand(matrix.shape[:1]), matrix, vector, **kwargs)


class AddmvRule(AddendEinsumRule):
    """`addmv` returns its addend's own shape, not the output's, when the matrix has no elements:
    a shard with no rows (5 rows on 4 ranks) or no columns would come out as shape (1,) or ().
    Expanding the addend to the local output first gives the local value one device computes."""

    def local_op(self, call, input_layouts, coordinate):
        return _addmv_with_full_addend


_PRODUCTS = {
    aten.mm.default: EinsumRule("mk,kn->mn"),
    aten.bmm.default: EinsumRule("bmk,bkn->bmn"),
    aten.mv.default: EinsumRule("mk,k->m"),
    aten.dot.default: EinsumRule("k,k->"),
    aten.vdot.default: EinsumRule("k,k->"),  # conj(a) . b: conjugation is additive, so still linear in a
    aten.addmm.default: AddendEinsumRule("mk,kn->mn"),
    aten.baddbmm.default: AddendEinsumRule("bmk,bkn->bmn"),
    aten.addmv.default: AddmvRule("mk,k->m"),
    aten.addr.default: AddendEinsumRule("m,n->mn"),
    aten.addbmm.default: AddendEinsumRule("bmk,bkn->mn"),  # the batch is summed too: S(b) gives P(sum)
}

for _op, _rule in _PRODUCTS.items():
    register_rule([_op], _rule)
