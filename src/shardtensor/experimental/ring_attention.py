"""Ring attention: exact scaled-dot-product attention over a sequence sharded along one mesh dim.

Each rank holds its queries and one block of keys/values; the k/v blocks travel around the mesh
dim (point to point to the next coordinate, or one all_gather), each rank attends its queries to
every block and merges the partial results by log-sum-exp in fp32 (or wider) (the online softmax). The
backward recomputes the probabilities from the saved log-sum-exp: dq stays local, while dk/dv
accumulators travel with their k/v block and are sent home at the end (or reduce-scattered).

The sequence is cut into chunks; `SequenceLayout` says which global chunks each coordinate holds.
With causal load balance the sequence is cut into 2 * world chunks and coordinate r holds chunks
r and 2 * world - 1 - r (head-tail), so every rank computes the same number of causal blocks.
Plain torch math: runs on CPU and CUDA alike.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import comm
from ..mesh import DeviceMesh

__all__ = ["SequenceLayout", "ring_attention", "ROTATE_METHODS"]

ROTATE_METHODS = ("allgather", "alltoall")


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceLayout:
    """Which global sequence chunks each of `world_size` coordinates holds, in local order."""

    world_size: int
    load_balance: bool

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.load_balance else 1

    @property
    def chunk_count(self) -> int:
        return self.world_size * self.chunks_per_rank

    def chunks(self, coordinate: int) -> tuple[int, ...]:
        """Global chunk indices held by `coordinate` (head-tail when load balanced)."""
        if self.load_balance:
            return (coordinate, self.chunk_count - 1 - coordinate)
        return (coordinate,)

    def global_order(self) -> list[int]:
        """The chunk indices in the order a gather over coordinates concatenates them."""
        return [chunk for coordinate in range(self.world_size) for chunk in self.chunks(coordinate)]

    def causal_work(self, coordinate: int) -> int:
        """Attention blocks (query chunk x key chunk) `coordinate` computes under a causal mask."""
        return sum(query_chunk + 1 for query_chunk in self.chunks(coordinate))


def _block_kind(query_chunk: int, key_chunk: int, is_causal: bool) -> str | None:
    """'full', 'diagonal' (causal mask inside the block) or None (masked out entirely, skipped)."""
    if not is_causal or key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else None


def _expand_heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: repeat each k/v head for the `groups` query heads sharing it (head dim is -3)."""
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


def _fold_heads(gradient: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of `_expand_heads`: sum the gradients of the query heads sharing a k/v head."""
    if groups == 1:
        return gradient
    shape = gradient.shape
    return gradient.unflatten(-3, (shape[-3] // groups, groups)).sum(-3)


def _scores(query: torch.Tensor, key: torch.Tensor, kind: str) -> torch.Tensor:
    scores = query @ key.transpose(-2, -1)
    if kind == "diagonal":
        rows, columns = scores.shape[-2:]
        masked = torch.ones(rows, columns, dtype=torch.bool, device=scores.device).triu(1)
        scores.masked_fill_(masked, float("-inf"))
    return scores


@dataclasses.dataclass(frozen=True, slots=True)
class _Ring:
    """The static facts of one call: mesh, layout, this coordinate, mask, GQA groups, rotation."""

    mesh: DeviceMesh
    layout: SequenceLayout
    coordinate: int
    is_causal: bool
    groups: int
    method: str
    dtype: torch.dtype  # the accumulation dtype: fp32, or the inputs' if wider

    def pairs(self, source: int):
        """(local query slot, source key slot, kind) for every block to compute against `source`'s k/v."""
        for query_slot, query_chunk in enumerate(self.layout.chunks(self.coordinate)):
            for key_slot, key_chunk in enumerate(self.layout.chunks(source)):
                kind = _block_kind(query_chunk, key_chunk, self.is_causal)
                if kind is not None:
                    yield query_slot, key_slot, kind

    def neighbours(self) -> tuple[int, int]:
        ranks = self.mesh.group_ranks(0)
        size = len(ranks)
        return ranks[(self.coordinate + 1) % size], ranks[(self.coordinate - 1) % size]

    def sources(self):
        """The coordinates whose k/v block this rank holds at each ring step."""
        return [(self.coordinate - step) % self.layout.world_size for step in range(self.layout.world_size)]


def _rotate(tensors: list[torch.Tensor], ring: _Ring):
    """Start sending `tensors` to the next coordinate and receiving the previous one's (async)."""
    following, preceding = ring.neighbours()
    operations = [comm.PointToPoint("send", tensor, following) for tensor in tensors]
    operations += [comm.PointToPoint("recv", torch.empty_like(tensor), preceding) for tensor in tensors]
    return comm.batch_p2p(operations, async_op=True, mesh=ring.mesh, mesh_dim=0)


def _gather_blocks(key: torch.Tensor, value: torch.Tensor, ring: _Ring) -> list[torch.Tensor]:
    """'allgather': one all_gather of stacked k/v; returns each coordinate's (2, ...) block."""
    local_size = key.shape[-2]
    stacked = torch.stack([key, value])
    gathered = comm.all_gather(stacked, ring.mesh, 0, dim=-2, sizes=[local_size] * ring.layout.world_size)
    return list(gathered.split(local_size, dim=-2))


def _key_value_blocks(key: torch.Tensor, value: torch.Tensor, ring: _Ring):
    """Yield (source coordinate, stacked k/v block) in ring order, overlapping the next transfer."""
    if ring.method == "allgather":
        blocks = _gather_blocks(key, value, ring)
        for source in ring.sources():
            yield source, blocks[source]
        return
    current = torch.stack([key, value])
    sources = ring.sources()
    for step, source in enumerate(sources):
        pending = _rotate([current], ring) if step + 1 < len(sources) else None
        yield source, current
        if pending is not None:
            current = pending.wait()[0]


def _forward(query, key, value, ring: _Ring, scale: float):
    """Output (fp32) and log-sum-exp per query row, merged over every k/v block."""
    chunks = ring.layout.chunks_per_rank
    scaled_queries = (query.to(ring.dtype) * scale).chunk(chunks, dim=-2)
    outputs = [None] * chunks
    log_sum_exps = [None] * chunks
    for source, block in _key_value_blocks(key, value, ring):
        keys = _expand_heads(block[0], ring.groups).to(ring.dtype).chunk(chunks, dim=-2)
        values = _expand_heads(block[1], ring.groups).to(ring.dtype).chunk(chunks, dim=-2)
        for query_slot, key_slot, kind in ring.pairs(source):
            scores = _scores(scaled_queries[query_slot], keys[key_slot], kind)
            block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            block_output = scores.sub_(block_lse).exp_() @ values[key_slot]  # in place: one block-sized buffer
            if outputs[query_slot] is None:
                outputs[query_slot], log_sum_exps[query_slot] = block_output, block_lse
                continue
            merged_lse = torch.logaddexp(log_sum_exps[query_slot], block_lse)
            outputs[query_slot] = (outputs[query_slot] * torch.exp(log_sum_exps[query_slot] - merged_lse)
                                   + block_output * torch.exp(block_lse - merged_lse))
            log_sum_exps[query_slot] = merged_lse
    return torch.cat(outputs, dim=-2), torch.cat(log_sum_exps, dim=-2)


def _block_gradients(scaled_queries, grad_outputs, deltas, log_sum_exps, block, gradient_block, grad_queries,
                     source, ring, scale):
    """Add this block's contribution to the local dq pieces and to the block's dk/dv (all in place)."""
    chunks = ring.layout.chunks_per_rank
    keys = _expand_heads(block[0], ring.groups).to(ring.dtype).chunk(chunks, dim=-2)
    values = _expand_heads(block[1], ring.groups).to(ring.dtype).chunk(chunks, dim=-2)
    grad_keys, grad_values = gradient_block[0].chunk(chunks, dim=-2), gradient_block[1].chunk(chunks, dim=-2)
    for query_slot, key_slot, kind in ring.pairs(source):
        scores = _scores(scaled_queries[query_slot], keys[key_slot], kind)
        probabilities = scores.sub_(log_sum_exps[query_slot]).exp_()
        grad_values[key_slot].add_(_fold_heads(probabilities.transpose(-2, -1) @ grad_outputs[query_slot], ring.groups))
        grad_probabilities = grad_outputs[query_slot] @ values[key_slot].transpose(-2, -1)
        grad_scores = grad_probabilities.sub_(deltas[query_slot]).mul_(probabilities)
        grad_queries[query_slot].add_(grad_scores @ keys[key_slot], alpha=scale)
        grad_keys[key_slot].add_(_fold_heads(grad_scores.transpose(-2, -1) @ scaled_queries[query_slot], ring.groups))


def _backward(grad_output, query, key, value, output, log_sum_exp, ring: _Ring, scale: float):
    chunks = ring.layout.chunks_per_rank
    scaled_queries = (query.to(ring.dtype) * scale).chunk(chunks, dim=-2)
    grad_output = grad_output.to(ring.dtype)
    grad_outputs = grad_output.chunk(chunks, dim=-2)
    deltas = (grad_output * output).sum(-1, keepdim=True).chunk(chunks, dim=-2)
    log_sum_exps = log_sum_exp.chunk(chunks, dim=-2)
    grad_query = torch.zeros_like(query, dtype=ring.dtype)
    grad_query_pieces = grad_query.chunk(chunks, dim=-2)
    block_shape = (2, *key.shape)
    if ring.method == "allgather":
        blocks = _gather_blocks(key, value, ring)
        gradients = torch.zeros((2, *key.shape[:-2], key.shape[-2] * ring.layout.world_size, key.shape[-1]),
                                dtype=ring.dtype, device=key.device)
        gradient_blocks = gradients.split(key.shape[-2], dim=-2)
        for source in ring.sources():
            _block_gradients(scaled_queries, grad_outputs, deltas, log_sum_exps, blocks[source],
                             gradient_blocks[source], grad_query_pieces, source, ring, scale)
        local = comm.reduce_scatter(gradients, ring.mesh, 0, reduce_op="sum", dim=-2,
                                    sizes=[key.shape[-2]] * ring.layout.world_size)
    else:
        current = torch.stack([key, value])
        travelling = torch.zeros(block_shape, dtype=ring.dtype, device=key.device)
        sources = ring.sources()
        for step, source in enumerate(sources):
            pending = _rotate([current], ring) if step + 1 < len(sources) else None
            _block_gradients(scaled_queries, grad_outputs, deltas, log_sum_exps, current, travelling,
                             grad_query_pieces, source, ring, scale)
            if pending is not None:  # the k/v arrive first, then their gradients follow them
                current = pending.wait()[0]
                travelling = _rotate([travelling], ring).wait()[0]
        local = _rotate([travelling], ring).wait()[0] if ring.layout.world_size > 1 else travelling
    return grad_query, local[0], local[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, ring: _Ring, scale: float):
        output, log_sum_exp = _forward(query, key, value, ring, scale)
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        ctx.ring, ctx.scale = ring, scale
        return output.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, log_sum_exp = ctx.saved_tensors
        grad_query, grad_key, grad_value = _backward(grad_output, query, key, value, output, log_sum_exp,
                                                     ctx.ring, ctx.scale)
        return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None


def _shape_error(query, key, value, detail: str) -> ValueError:
    return ValueError(
        f"context_parallel attention: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
        f"{tuple(value.shape)} (local shards, sequence dim -2, heads dim -3): {detail}"
    )


def ring_attention(query, key, value, *, mesh: DeviceMesh, layout: SequenceLayout, is_causal: bool,
                   scale: float | None, enable_gqa: bool, method: str) -> torch.Tensor:
    """Exact attention of this rank's query shard against the whole (sharded) key/value sequence."""
    if key.shape != value.shape or key.shape[-2] != query.shape[-2]:
        raise _shape_error(query, key, value, "ring attention needs key and value of the same shape and the "
                           "same local sequence length as the query (all sharded along their sequence dim "
                           "by the context)")
    if query.shape[-2] % layout.chunks_per_rank:
        raise _shape_error(query, key, value, f"with causal load balance the local sequence length must be "
                           f"divisible by 2 (the global one by 2 * world size = {layout.chunk_count})")
    groups = 1
    if query.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        if not enable_gqa or query.shape[-3] % key.shape[-3]:
            raise _shape_error(query, key, value, "query heads differ from key/value heads; pass enable_gqa=True "
                               "with a number of query heads divisible by the number of key/value heads")
        groups = query.shape[-3] // key.shape[-3]
    ring = _Ring(mesh, layout, mesh.get_local_rank(0), is_causal, groups, method,
                 torch.promote_types(query.dtype, torch.float32))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _RingAttention.apply(query, key, value, ring, scale)
