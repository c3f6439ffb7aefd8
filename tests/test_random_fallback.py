"""Random ops without a rule of their own (poisson, multinomial) go through the replicate fallback:
every rank computes the whole op, seeded alike from the library's seed and call number, so a
Replicate result holds the same values on every rank and any layout of the input gives the same
global tensor; torch's own generator is left as it was."""

import torch
from helpers import with_fallback_draws
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

SEED = 11


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

    for counter, result in enumerate((sharded, replicated)):
        expected = with_fallback_draws(lambda: torch.poisson(rates), seed=SEED, counter=counter)
        assert_close(result.full_tensor(), expected, rtol=0, atol=0)
    expected_samples = with_fallback_draws(lambda: torch.multinomial(weights, 4), seed=SEED, counter=2)
    every_rank = comm.all_gather_object(samples.to_local(), mesh, None)
    for local in every_rank:
        assert torch.equal(local, expected_samples)
    assert torch.equal(torch.get_rng_state(), own_generator)  # the fallback restored torch's generator
