"""Elementwise ops on DTensors: every family gives the single-device result through its rule."""

import pytest
import torch
from helpers import partial_and_value
from spmd import spmd

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.ops.registry import RULES

aten = torch.ops.aten

UNARY = [
    torch.abs, torch.exp, torch.expm1, torch.sigmoid, torch.tanh, torch.floor, torch.ceil, torch.round, torch.trunc,
    torch.sign, torch.sin, torch.cos, torch.atan, torch.erf, torch.neg, torch.relu, torch.frac, torch.square,
    torch.nn.functional.gelu, torch.nn.functional.silu, torch.nn.functional.mish, torch.nn.functional.hardswish,
    torch.nn.functional.hardsigmoid, torch.nn.functional.hardtanh, torch.nn.functional.elu,
    torch.nn.functional.leaky_relu, torch.nn.functional.softplus, torch.nn.functional.logsigmoid,
    lambda x: x.abs().log(), lambda x: x.abs().sqrt(), lambda x: x.abs().rsqrt(), lambda x: torch.clamp(x, -1, 1),
    lambda x: torch.nan_to_num(x), lambda x: x.pow(2), lambda x: 2 ** x, lambda x: x.isnan(), lambda x: x.signbit(),
]
BINARY = [
    torch.add, torch.sub, torch.mul, torch.div, torch.maximum, torch.minimum, torch.fmax, torch.atan2, torch.hypot,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logaddexp, torch.copysign, torch.xlogy,
    lambda a, b: torch.remainder(a, b.abs() + 1), lambda a, b: torch.div(a, b, rounding_mode="floor"),
    lambda a, b: torch.logical_and(a > 0, b > 0), lambda a, b: torch.add(a, b, alpha=3), lambda a, b: 2 - a,
]
TERNARY = [
    lambda a, b, c: torch.where(c > 0, a, b), lambda a, b, c: torch.addcmul(a, b, c, value=0.5),
    lambda a, b, c: torch.addcdiv(a, b, c.abs() + 1), lambda a, b, c: torch.lerp(a, b, c),
    lambda a, b, c: torch.lerp(a, b, 0.25), lambda a, b, c: torch.clamp(a, min=b, max=b + c.abs()),
]


def _sharded(mesh):
    return [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)


def _full(seed: int, shape=(6, 5)) -> torch.Tensor:
    return torch.linspace(-2.5, 2.5, 30).reshape(shape).roll(seed, 1) + 0.1 * seed


@spmd()
def test_elementwise_families_are_local_and_exact(mesh):
    a_full, b_full, c_full = _full(0), _full(1), _full(2)
    a, b, c = (distribute_tensor(t, mesh, _sharded(mesh)) for t in (a_full, b_full, c_full))
    with shardtensor.strict_mode(), comm.observe() as records:
        results = [op(a) for op in UNARY] + [op(a, b) for op in BINARY] + [op(a, b, c) for op in TERNARY]
    assert list(records) == []
    expected = [op(a_full) for op in UNARY] + [op(a_full, b_full) for op in BINARY]
    expected += [op(a_full, b_full, c_full) for op in TERNARY]
    for result, reference in zip(results, expected):
        assert result.placements == a.placements
        torch.testing.assert_close(result.full_tensor(), reference, rtol=0, atol=0, equal_nan=True)


@spmd(meshes=[(2,), (2, 2)])
def test_integer_bitwise_and_casts(mesh):
    full = torch.arange(-12, 12).reshape(4, 6)
    x = distribute_tensor(full, mesh, _sharded(mesh))
    with shardtensor.strict_mode():
        results = [x & 5, x | 2, x ^ 7, ~x, x << 1, x >> 1, x.float() / 3, x.to(torch.float64), (x > 0).int()]
    expected = [full & 5, full | 2, full ^ 7, ~full, full << 1, full >> 1, full.float() / 3, full.double(),
                (full > 0).int()]
    for result, reference in zip(results, expected):
        assert result.dtype == reference.dtype and torch.equal(result.full_tensor(), reference)


@spmd(meshes=[(1,), (2,), (4,), (2, 2)])
def test_broadcasting_shards_only_dims_every_input_spans(mesh):
    matrix, row, column = _full(0), torch.linspace(0, 1, 5), torch.linspace(1, 2, 6).reshape(6, 1)
    a = distribute_tensor(matrix, mesh, _sharded(mesh))
    r = distribute_tensor(row, mesh, [Replicate()] * mesh.ndim)
    s = distribute_tensor(column, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    with shardtensor.strict_mode(), comm.observe() as records:
        result = torch.where(a > 0, a * r, s)
    assert list(records) == []
    assert torch.equal(result.full_tensor(), torch.where(matrix > 0, matrix * row, column))


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_in_place_and_out_variants(mesh):
    a_full, b_full = _full(0), _full(1)
    a = distribute_tensor(a_full.clone(), mesh, _sharded(mesh))
    b = distribute_tensor(b_full, mesh, _sharded(mesh))
    with shardtensor.strict_mode():
        a.mul_(b).add_(1).clamp_(-2, 2).sigmoid_()
        torch.where(b > 0, a, b, out=(out := torch.empty_like(a)))
        torch.addcmul(a, a, b, out=(out2 := torch.empty_like(a)))
    reference = (a_full * b_full + 1).clamp(-2, 2).sigmoid()
    torch.testing.assert_close(a.full_tensor(), reference, rtol=0, atol=0)
    torch.testing.assert_close(out.full_tensor(), torch.where(b_full > 0, reference, b_full), rtol=0, atol=0)
    torch.testing.assert_close(out2.full_tensor(), torch.addcmul(reference, reference, b_full), rtol=0, atol=0)


ACTIVATIONS = [
    torch.relu, torch.sigmoid, torch.tanh, torch.nn.functional.gelu, torch.nn.functional.silu,
    torch.nn.functional.mish, torch.nn.functional.hardswish, torch.nn.functional.hardsigmoid,
    torch.nn.functional.hardtanh, torch.nn.functional.elu, torch.nn.functional.leaky_relu,
    torch.nn.functional.softplus, torch.nn.functional.logsigmoid, lambda x: torch.logit(torch.sigmoid(x), 1e-3),
    lambda x: torch.where(x > 0, x * x, -x), lambda x: torch.lerp(x, x.exp(), 0.3), lambda x: x.clamp(-1, 1),
]


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_backward_ops_of_activations(mesh):
    full = _full(0).double()
    for activation in ACTIVATIONS:
        leaf = distribute_tensor(full.clone().requires_grad_(), mesh, _sharded(mesh))
        with shardtensor.strict_mode():
            (activation(leaf) * 3).backward(torch.ones_like(leaf))
        reference = full.clone().requires_grad_()
        (activation(reference) * 3).backward(torch.ones_like(reference))
        torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad, rtol=1e-12, atol=1e-12)


def test_the_family_is_registered_with_in_place_and_out_overloads():
    for op in [aten.add.Tensor, aten.add_.Tensor, aten.add.out, aten.where.self, aten.where.self_out,
               aten.clamp.Tensor, aten.clamp_.Tensor, aten.lerp.Scalar, aten.addcdiv_.default, aten._to_copy.default,
               aten.threshold_backward.default, aten.gelu_backward.default, aten.bitwise_and.Tensor]:
        assert op in RULES, op


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@spmd(meshes=[(2,)])
def test_python_scalars_keep_the_single_device_dtype(mesh, dtype):
    full = torch.arange(6).to(dtype)
    x = distribute_tensor(full, mesh, [Shard(0)])
    with shardtensor.strict_mode():
        for result, reference in [(x * 2, full * 2), (x * 2.5, full * 2.5), (x + True, full + True), (x / 2, full / 2)]:
            assert result.dtype == reference.dtype and torch.equal(result.full_tensor(), reference)


SPECIAL_UNARY = [
    torch.special.airy_ai, torch.special.bessel_j0, torch.special.bessel_j1, torch.special.bessel_y0,
    torch.special.bessel_y1, torch.special.modified_bessel_i0, torch.special.modified_bessel_i1,
    torch.special.modified_bessel_k0, torch.special.modified_bessel_k1, torch.special.scaled_modified_bessel_k0,
    torch.special.scaled_modified_bessel_k1, torch.special.spherical_bessel_j0,
]
# Polynomials of x (a DTensor, or a Python number) and degree n (a DTensor, or a Python int).
SPECIAL_POLYNOMIALS = [
    torch.special.chebyshev_polynomial_t, torch.special.chebyshev_polynomial_u, torch.special.chebyshev_polynomial_v,
    torch.special.chebyshev_polynomial_w, torch.special.shifted_chebyshev_polynomial_t,
    torch.special.shifted_chebyshev_polynomial_u, torch.special.shifted_chebyshev_polynomial_v,
    torch.special.shifted_chebyshev_polynomial_w, torch.special.hermite_polynomial_h,
    torch.special.hermite_polynomial_he, torch.special.laguerre_polynomial_l, torch.special.legendre_polynomial_p,
]


@spmd()
def test_special_functions_frexp_and_ldexp_are_local(mesh):
    x_full = _full(0).double().abs() + 0.1  # 6 x 5: uneven on 4 ranks
    degree_full = torch.arange(30).reshape(6, 5) % 5
    x, degree = (distribute_tensor(t, mesh, _sharded(mesh)) for t in (x_full, degree_full))
    with shardtensor.strict_mode(), comm.observe() as records:
        results = [function(x) for function in SPECIAL_UNARY]
        for polynomial in SPECIAL_POLYNOMIALS:
            results += [polynomial(x / 3, degree), polynomial(0.25, degree), polynomial(x / 3, 3)]
        results += list(torch.frexp(x)) + [torch.ldexp(x, degree), x.clone().ldexp_(degree)]
    assert list(records) == []
    expected = [function(x_full) for function in SPECIAL_UNARY]
    for polynomial in SPECIAL_POLYNOMIALS:
        expected += [polynomial(x_full / 3, degree_full), polynomial(0.25, degree_full), polynomial(x_full / 3, 3)]
    expected += list(torch.frexp(x_full)) + [torch.ldexp(x_full, degree_full)] * 2
    for result, reference in zip(results, expected, strict=True):
        assert result.placements == x.placements
        torch.testing.assert_close(result.full_tensor(), reference, rtol=0, atol=0, equal_nan=True)


@spmd(meshes=[(2,), (2, 2)])
def test_ldexp_keeps_a_partial_mantissa_and_gradients_match(mesh):
    partial, partial_full = partial_and_value(mesh, (4, 3))
    exponent_full = torch.arange(12).reshape(4, 3) % 3
    exponent = distribute_tensor(exponent_full, mesh, [Replicate()] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        result = torch.ldexp(partial, exponent)
    assert list(records) == [] and result.placements == (Partial(),) * mesh.ndim
    torch.testing.assert_close(result.full_tensor(), torch.ldexp(partial_full, exponent_full))
    full = torch.rand(4, 3, dtype=torch.float64) + 0.5
    leaf = distribute_tensor(full.clone().requires_grad_(), mesh, _sharded(mesh))
    reference = full.clone().requires_grad_()
    with shardtensor.strict_mode():
        (torch.special.bessel_j0(leaf) * torch.ldexp(leaf, exponent)).sum().backward()
    (torch.special.bessel_j0(reference) * torch.ldexp(reference, exponent_full)).sum().backward()
    torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)
