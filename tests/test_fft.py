"""FFTs, complex views and conjugate views on DTensors, forward and backward, against one device."""

import torch
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

R = Replicate()

# name -> (function of x, whether x is complex). Every transform acts on dims 1 and 2 (or the last
# dim) of a (5, 4, 6) input; dim 0 (5 rows: uneven on 2 and 4 ranks) is never transformed.
FFTS = {
    "fft": (lambda x: torch.fft.fft(x), False),
    "ifft": (lambda x: torch.fft.ifft(x, norm="ortho"), True),
    "rfft": (lambda x: torch.fft.rfft(x), False),
    "irfft": (lambda x: torch.fft.irfft(x, n=7), True),
    "hfft": (lambda x: torch.fft.hfft(x), True),
    "ihfft": (lambda x: torch.fft.ihfft(x), False),
    "fft2": (lambda x: torch.fft.fft2(x), True),
    "rfftn": (lambda x: torch.fft.rfftn(x, dim=(1, 2)), False),
    "irfft2": (lambda x: torch.fft.irfft2(x, s=(4, 10)), True),
    "hfft2": (lambda x: torch.fft.hfft2(x, norm="forward"), True),
    "ihfftn": (lambda x: torch.fft.ihfftn(x, dim=(1, 2)), False),
}


def _on(mesh, one_dim, two_dim):
    return one_dim if mesh.ndim == 1 else two_dim


def _input(is_complex: bool) -> torch.Tensor:
    return torch.randn(5, 4, 6, dtype=torch.complex128 if is_complex else torch.float64)


def _compare_forward_and_backward(function, full, placements, mesh, *, local: bool):
    """Forward and a strict-mode backward against one device; `local`: no collective in either."""
    x = distribute_tensor(full, mesh, placements).requires_grad_()
    reference = full.clone().requires_grad_()
    expected = function(reference)
    with shardtensor.strict_mode(), comm.observe() as records:
        y = function(x)
    if local:
        assert records == [], [record.kind for record in records]
        assert y.placements == x.placements
    assert_close(y.full_tensor(), expected)
    grad = torch.randn_like(expected)
    output_placements = [R if placement.is_partial() else placement for placement in y.placements]
    distributed_grad = distribute_tensor(grad, mesh, output_placements)
    with shardtensor.strict_mode(), comm.observe() as records:
        y.backward(distributed_grad)
    if local:
        assert records == [], [record.kind for record in records]
    expected.backward(grad)
    assert_close(x.grad.full_tensor(), reference.grad)


@spmd()
def test_ffts_shard_untransformed_dims_locally_and_move_transformed_ones(mesh):
    for name, (function, is_complex) in FFTS.items():
        full = _input(is_complex)
        untransformed = _on(mesh, [Shard(0)], [Shard(0), Shard(0)])
        _compare_forward_and_backward(function, full, untransformed, mesh, local=True)
        transformed = _on(mesh, [Shard(2)], [Shard(2), Shard(0)])
        _compare_forward_and_backward(function, full, transformed, mesh, local=False)


@spmd(meshes=[(4,), (2, 2)])
def test_fft_of_empty_shards_works_on_every_rank(mesh):
    """A dim smaller than the mesh leaves some shards empty; MKL rejects an empty batch, which used to
    raise on those ranks only while the others waited in their next collective."""
    full = torch.randn(3, 8, dtype=torch.complex128)
    for function in (torch.fft.fft, torch.fft.irfft, torch.fft.hfft):
        _compare_forward_and_backward(function, full, [Shard(0)] * mesh.ndim, mesh, local=True)


@spmd(meshes=[(4,), (2, 2)])
def test_hermitian_ffts_of_the_opinfo_failures(mesh):
    """fft.hfft (backward: view_as_real of a conjugate view) and fft.hfft2 on 2x2 (wrong values on
    half the ranks, then a hang): the samples of the OpInfo sweep, gradient through full_tensor."""
    full = torch.randn(5, 6, 7, dtype=torch.complex64)
    cases = [
        (lambda x: torch.fft.hfft(x), _on(mesh, [Shard(1)], [R, Shard(0)])),
        (lambda x: torch.fft.hfft2(x, s=(3, 10), dim=(1, 2), norm="ortho"), _on(mesh, [Shard(1)], [Shard(1), R])),
        (lambda x: torch.fft.hfft2(x, norm="ortho"), _on(mesh, [Shard(2)], [Shard(1), Shard(2)])),
    ]
    for function, placements in cases:
        x = distribute_tensor(full, mesh, placements).requires_grad_()
        reference = full.clone().requires_grad_()
        with shardtensor.strict_mode():
            y = function(x).full_tensor()
            y.sum().backward()
        expected = function(reference)
        expected.sum().backward()
        assert_close(y, expected)
        assert_close(x.grad.full_tensor(), reference.grad)


@spmd()
def test_complex_views_and_constructors_keep_shards(mesh):
    real, imag = torch.randn(5, 3, dtype=torch.float64), torch.rand(5, 3, dtype=torch.float64)
    pairs = torch.randn(5, 3, 2, dtype=torch.float64)
    z = torch.randn(5, 3, dtype=torch.complex128)
    placements = _on(mesh, [Shard(0)], [Shard(0), Shard(1)])
    cases = [
        (torch.view_as_real, [z]),
        (torch.view_as_complex, [pairs]),
        (lambda value: torch.view_as_real(value.conj().resolve_conj()), [z]),
        (lambda value: torch.view_as_real(torch._neg_view(value).resolve_neg()), [z]),
        (torch.complex, [real, imag]),
        (torch.polar, [imag, real]),
        (torch.angle, [z]),
        (torch.abs, [z]),
        (torch.real, [z]),
        (torch.imag, [z]),
    ]
    for function, fulls in cases:
        leaves = [distribute_tensor(full, mesh, placements).requires_grad_() for full in fulls]
        references = [full.clone().requires_grad_() for full in fulls]
        with shardtensor.strict_mode(), comm.observe() as records:
            y = function(*leaves)
        assert records == [], [record.kind for record in records]
        assert y.placements == tuple(placements)
        expected = function(*references)
        assert_close(y.full_tensor(), expected)
        grad = torch.randn_like(expected)
        with shardtensor.strict_mode():
            y.backward(distribute_tensor(grad, mesh, placements))
        expected.backward(grad)
        for leaf, reference in zip(leaves, references):
            assert_close(leaf.grad.full_tensor(), reference.grad)


@spmd()
def test_view_as_complex_needs_the_pair_dim_whole(mesh):
    pairs = torch.randn(4, 2, dtype=torch.float64)
    x = distribute_tensor(pairs, mesh, [Shard(1)] * mesh.ndim)
    with shardtensor.strict_mode():
        y = torch.view_as_complex(x)
    assert all(placement in (R, Shard(0)) for placement in y.placements)  # never the (real, imaginary) dim
    assert torch.equal(y.full_tensor(), torch.view_as_complex(pairs))


@spmd()
def test_conjugate_views_redistribute_and_gather(mesh):
    """A shard with the conjugate bit: the DTensor reports it like a tensor on one device, and
    collectives send the conjugated values (c10d sends memory, which holds the unconjugated ones)."""
    full = torch.randn(5, 6, dtype=torch.complex128)
    x = distribute_tensor(full, mesh, _on(mesh, [Shard(0)], [Shard(0), Shard(1)]))
    conjugate = x.conj()
    assert conjugate.is_conj() and conjugate.to_local().is_conj()
    assert torch.equal(conjugate.full_tensor(), full.conj())
    for placements in ([R] * mesh.ndim, [Shard(1)] * mesh.ndim, _on(mesh, [Shard(1)], [Shard(1), Shard(0)])):
        moved = conjugate.redistribute(mesh, placements)
        assert torch.equal(moved.full_tensor(), full.conj())
        resolved = torch.view_as_real(conjugate.resolve_conj())
        assert not resolved.is_conj()
        assert torch.equal(resolved.redistribute(mesh, placements).full_tensor(), torch.view_as_real(full.conj().resolve_conj()))
    negative = torch._neg_view(x)
    assert negative.is_neg()
    assert torch.equal(negative.redistribute(mesh, [R] * mesh.ndim).to_local(), -full)


@spmd(meshes=[(2,), (2, 2)])
def test_ffts_keep_partial_sums(mesh):
    """FFTs are linear: a Partial(sum) input gives a Partial(sum) output, reduced only on request."""
    full = torch.randn(4, 6, dtype=torch.float64)
    first = all(coordinate == 0 for coordinate in mesh.get_coordinate())
    local = full if first else torch.zeros_like(full)
    x = shardtensor.DTensor.from_local(local, mesh, [shardtensor.Partial()] * mesh.ndim, shape=full.shape)
    for function in (torch.fft.rfft, lambda value: torch.fft.irfft(torch.fft.fft(value))):
        with shardtensor.strict_mode(), comm.observe() as records:
            y = function(x)
        assert records == [] and all(placement.is_partial() for placement in y.placements)
        assert_close(y.full_tensor(), function(full))
