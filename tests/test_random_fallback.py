"""Random ops without a rule of their own (poisson, multinomial) go through the replicate fallback:
every rank computes the whole op, seeded alike from the library's seed and call number, so a
Replicate result holds the same values on every rank and any layout of the input gives the same
global tensor; torch's own generator is left as it was."""

import hashlib

import torch
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

SEED = 11


def _documented_generator_seed(counter: int) -> int:
    """The seed `random.same_draws_on_every_rank` documents: blake2b("seed:counter:-1"), 63 bits."""
    digest = hashlib.blake2b(f"{SEED}:{counter}:-1".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _single_device(function, counter: int) -> torch.Tensor:
    """`function()` on one device, torch's generator seeded by the documented rule."""
    generator_state = torch.get_rng_state()
    torch.manual_seed(_documented_generator_seed(counter))
    try:
        return function()
    finally:
        torch.set_rng_state(generator_state)


@spmd(meshes=[(1,), (2,), (4,), (2, 2)])
def test_poisson_and_multinomial_draw_alike_on_every_rank(mesh):
    rates = torch.arange(1.0, 25.0, dtype=torch.float64).reshape(8, 3)
    weights = torch.arange(1.0, 13.0).reshape(2, 6)
    torch.manual_seed(1000 + mesh.get_rank())  # each rank's own generator differs
    own_generator = torch.get_rng_state()
    shardtensor.random.manual_seed(SEED)

    sharded = torch.poisson(distribute_tensor(rates, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)))
    replicated = torch.poisson(distribute_tensor(rates, mesh, [Replicate()] * mesh.ndim))
    samples = torch.multinomial(distribute_tensor(weights, mesh, [Replicate()] * mesh.ndim), 4)

    assert_close(sharded.full_tensor(), _single_device(lambda: torch.poisson(rates), counter=0), rtol=0, atol=0)
    assert_close(replicated.full_tensor(), _single_device(lambda: torch.poisson(rates), counter=1), rtol=0, atol=0)
    expected_samples = _single_device(lambda: torch.multinomial(weights, 4), counter=2)
    every_rank = comm.all_gather_object(samples.to_local(), mesh, None)
    for local in every_rank:
        assert torch.equal(local, expected_samples)
    assert torch.equal(torch.get_rng_state(), own_generator)  # the fallback restored torch's generator
