"""Run PyTorch's OpInfo database on distributed tensors and classify every op.

For each OpInfo (float32 samples on CPU) and each of its sample inputs, every tensor argument is
distributed with random placements (Shard on a dim of size >= 1, or Replicate; seeded, so every
rank picks the same), the op runs, and `full_tensor()` of every output is compared with the
single-device result; where the OpInfo supports autograd, the input gradients of the sum of the
outputs are compared too. An op is "native" (correct, no replicate fallback), "fallback"
(correct through shardtensor's replicate fallback), or "failing" (wrong or an error, with a
one-line reason). An op whose inputs the library refuses up front with a clear error on every
rank (sparse tensors: a TypeError from `distribute_tensor`) is "refused" and counted apart. Ops that
draw random numbers (tests/test_random.py covers them), return uninitialized memory or have no CPU
sample are "skipped" and left out of the count.

The same harness runs against `torch.distributed.tensor` (`--library torch`), where an op counts
as native when it raises nothing, so both numbers compare.

Opt-in checks: `--variants inplace,out` also runs each OpInfo's in-place variant (`x.add_(...)`:
the mutated input and the returned object are checked) and `out=` variant (into DTensors with
random placements, pre-filled with a sentinel), forward only, reported as `key:inplace` and
`key:out`. `--partial` makes floating inputs Partial(sum) on a mesh dim: coordinate 0 holds 2x,
coordinate 1 holds -x, the others zeros (exact in floating point in any summation order, and wrong
for a rule that lets Partial through a nonlinear op such as relu, abs or exp).

    python tools/opinfo_sweep.py --library shardtensor            # every op, meshes (4,) and (2, 2)
    python tools/opinfo_sweep.py --library torch --ops add,mm,sum
    python tools/opinfo_sweep.py --ops add,mul,abs --variants plain,inplace,out --partial
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import random
import sys
import time
import warnings
import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["OpResult", "check_op", "op_keys", "sweep", "summary_line", "main"]

MESH_SHAPES = ((4,), (2, 2))
WORLD_SIZE = 4
# Sharded reductions add in another order than one device does: allow float32 rounding of that size.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
STATUS_ORDER = {"native": 0, "fallback": 1, "refused": 2, "skipped": 3, "failing": 4}
# What a library raises when it refuses an input up front (before any collective, on every rank).
REFUSALS = (TypeError, ValueError, NotImplementedError)
# Ops whose output is uninitialized memory: nothing to compare.
UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
# How each OpInfo is called: its function, its in-place variant, or its function with `out=`.
VARIANTS = ("plain", "inplace", "out")
# What an `out=` tensor holds before the op writes it: a value no correct result keeps everywhere.
OUT_SENTINEL = 7


@dataclasses.dataclass(frozen=True, slots=True)
class OpResult:
    """How one op fared: status is native, fallback, refused, failing or skipped; reason says why."""

    key: str
    status: str
    reason: str = ""
    samples: int = 0


# --- the op database ---------------------------------------------------------------------------------
_op_infos: dict[str, object] | None = None


def _database() -> dict[str, object]:
    """OpInfos with float32 CPU support, by key (`name` or `name.variant`); imported once per process."""
    global _op_infos
    if _op_infos is None:
        from torch.testing._internal.common_methods_invocations import op_db

        _op_infos = {}
        for info in op_db:
            if torch.float32 in info.supported_dtypes("cpu"):
                key = f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name
                _op_infos[key] = info
    return _op_infos


def op_keys() -> list[str]:
    """Every OpInfo key the sweep covers, in database order."""
    return list(_database())


# --- the two libraries ---------------------------------------------------------------------------------
class _Library:
    """What the harness needs from a DTensor library: meshes, placements, distribute, fallback count."""

    def __init__(self, name: str):
        if name == "shardtensor":
            import shardtensor
            from shardtensor import dispatch

            self.init_device_mesh = shardtensor.init_device_mesh
            self.distribute_tensor = shardtensor.distribute_tensor
            self.Shard, self.Replicate, self.DTensor = shardtensor.Shard, shardtensor.Replicate, shardtensor.DTensor
            self.Partial = shardtensor.Partial
            self.fallbacks = lambda: collections.Counter(dispatch.fallback_counts)
        elif name == "torch":
            warnings.filterwarnings("ignore", message="DTensor random operators")
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
            from torch.distributed import tensor
            from torch.distributed.device_mesh import init_device_mesh

            self.init_device_mesh = init_device_mesh
            self.distribute_tensor = tensor.distribute_tensor
            self.Shard, self.Replicate, self.DTensor = tensor.Shard, tensor.Replicate, tensor.DTensor
            self.Partial = tensor.Partial
            self.fallbacks = collections.Counter  # no fallback: an op without a rule raises
        else:
            raise ValueError(f"unknown library {name!r}; choose 'shardtensor' or 'torch'")
        self.name = name


_libraries: dict[str, _Library] = {}
_meshes: dict[tuple[str, tuple[int, ...]], object] = {}


def _library(name: str) -> _Library:
    if name not in _libraries:
        _libraries[name] = _Library(name)
    return _libraries[name]


def _mesh(library: _Library, mesh_shape: tuple[int, ...]):
    key = (library.name, tuple(mesh_shape))
    if key not in _meshes:
        _meshes[key] = library.init_device_mesh("cpu", tuple(mesh_shape))
    return _meshes[key]


# --- one op on every rank ------------------------------------------------------------------------------
def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


def _samples(info, max_samples: int) -> list:
    """The OpInfo's first samples, identical on every rank (seeded by the op's name)."""
    torch.manual_seed(_seed(info.name))
    random.seed(_seed(info.name))
    samples = []
    for sample in info.sample_inputs("cpu", torch.float32, requires_grad=info.supports_autograd):
        samples.append(sample)
        if len(samples) == max_samples:
            break
    return samples


def _call(info, sample_arguments):
    sample_input, args, kwargs = sample_arguments
    return info.op(sample_input, *args, **kwargs)


def _arguments(sample) -> tuple:
    return (sample.input, tuple(sample.args), dict(sample.kwargs))


def _fresh_copies(arguments):
    """The arguments with every tensor replaced by a leaf copy (keeping requires_grad)."""
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone().requires_grad_(value.requires_grad)
        return value
    return tree_map(copy, arguments)


def _random_placements(library: _Library, tensor: torch.Tensor, mesh_ndim: int, chooser: random.Random):
    choices = [library.Replicate()] + [library.Shard(dim) for dim in range(tensor.ndim) if tensor.shape[dim] >= 1]
    return [chooser.choice(choices) for _ in range(mesh_ndim)]


def _partial_local(library: _Library, mesh, value: torch.Tensor, placements: list):
    """This rank's local tensor of `value` with `placements`, where Partial(sum) mesh dims split it.

    On the first Partial mesh dim coordinate 0 holds 2x, coordinate 1 holds -x and the others
    zeros (x and zeros when `value` is not finite); on further ones coordinate 0 holds it all. Every
    partial sum of these is exact, so any summation order gives `value` back bit for bit.
    """
    replicated = [library.Replicate() if isinstance(p, library.Partial) else p for p in placements]
    local = library.distribute_tensor(value, mesh, replicated).to_local()
    signed = bool(torch.isfinite(value).all())
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, library.Partial):
            continue
        position = coordinate[mesh_dim]
        if signed and position < 2:
            local = local * (2.0 if position == 0 else -1.0)
        elif position > 0:
            local = torch.zeros_like(local)
        signed = False
    return local


class _Refused(Exception):
    """The library refused an input when it was distributed (the reason is the exception's first line)."""


def _distribute(library: _Library, mesh, arguments, chooser: random.Random, partial: bool = False):
    """Every tensor argument as a leaf DTensor with random placements; also returns those leaves.

    With `partial`, the first floating tensor is Partial(sum) on mesh dim 0 and later floating
    tensors are Partial on a mesh dim with probability 1/2 (random placements elsewhere). A
    refusal (`REFUSALS`) raises `_Refused`.
    """
    leaves = []
    partial_given = []

    def convert(value):
        if not isinstance(value, torch.Tensor):
            return value
        placements = _random_placements(library, value, mesh.ndim, chooser)
        if partial and value.dtype.is_floating_point and (not partial_given or chooser.random() < 0.5):
            placements[0 if not partial_given else chooser.randrange(mesh.ndim)] = library.Partial()
            partial_given.append(True)
            local = _partial_local(library, mesh, value.detach(), placements)
            dtensor = library.DTensor.from_local(local, mesh, placements, shape=value.shape, stride=value.stride())
        else:
            try:
                dtensor = library.distribute_tensor(value.detach(), mesh, placements)
            except REFUSALS as error:
                raise _Refused(f"distribute_tensor raised {type(error).__name__}: {_first_line(error)}") from None
        if value.requires_grad:
            dtensor.requires_grad_(True)
        leaves.append(dtensor)
        return dtensor

    return tree_map(convert, arguments), leaves


def _differentiable(outputs: list) -> list:
    return [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point]


def _compare(what: str, actual, expected) -> str:
    """'' when equal (within TOLERANCE), else a one-line reason."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{what}: expected a tensor, got {type(actual).__name__}"
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True, **TOLERANCE)
        except AssertionError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            return f"{what}: {lines[0]}" + (f" ({lines[1]})" if len(lines) > 1 else "")
        return ""
    if actual != expected:
        return f"{what}: expected {expected!r}, got {actual!r}"
    return ""


def _gathered(library: _Library, value):
    if isinstance(value, library.DTensor):
        return value.full_tensor()
    return value


class _SeededOps(TorchDispatchMode):
    """Records whether any aten op drew random numbers: one tagged `nondeterministic_seeded` that moved
    the default generator. The tag alone says that an op may draw: torch 2.14 runs the 3-D samples of
    `scaled_dot_product_attention` through its CPU flash kernel, tagged for a dropout that it does not
    support on CPU, so it draws nothing."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **(kwargs or {}))
        state = torch.random.get_rng_state()
        result = func(*args, **(kwargs or {}))
        self.seen = self.seen or not torch.equal(state, torch.random.get_rng_state())
        return result


def _is_random(info, arguments) -> bool:
    """True when the single-device op draws random numbers (dropout, bernoulli, ...).

    OpInfos of random ops reseed inside the op, so their outputs look deterministic; an aten op
    that is tagged `nondeterministic_seeded` and moves the generator is what tells.
    """
    mode = _SeededOps()
    try:
        with torch.no_grad(), mode:
            _call(info, _fresh_copies(arguments))
    except Exception:
        return False
    return mode.seen


def _check_sample(library: _Library, mesh, info, sample, chooser: random.Random, partial: bool = False) -> str | None:
    """'' if the sample matches, a reason if not, None if the single-device op itself rejects it."""
    arguments = _arguments(sample)
    reference_arguments = _fresh_copies(arguments)
    try:
        expected = tree_flatten(_call(info, reference_arguments))[0]
    except Exception:
        return None
    distributed_arguments, leaves = _distribute(library, mesh, arguments, chooser, partial)
    placements = "; ".join(str(tuple(str(p) for p in leaf.placements)) for leaf in leaves)
    try:
        outputs = tree_flatten(_call(info, distributed_arguments))[0]
        actual = [_gathered(library, output) for output in outputs]
    except Exception as error:
        return f"forward raised {type(error).__name__}: {_first_line(error)} [{placements}]"
    if len(actual) != len(expected):
        return f"forward returned {len(actual)} values, expected {len(expected)} [{placements}]"
    for index, (actual_value, expected_value) in enumerate(zip(actual, expected)):
        reason = _compare(f"output {index}", actual_value, expected_value)
        if reason:
            return f"{reason} [{placements}]"
    expected_differentiable = _differentiable(expected)
    if not info.supports_autograd or not expected_differentiable:
        return ""
    reference_leaves = [v for v in tree_flatten(reference_arguments)[0] if isinstance(v, torch.Tensor)]
    try:
        sum(output.sum() for output in expected_differentiable).backward()
    except Exception:
        return ""  # no single-device backward to compare against
    try:
        sum(output.sum() for output in _differentiable(actual)).backward()
        gradients = [None if leaf.grad is None else _gathered(library, leaf.grad) for leaf in leaves]
    except Exception as error:
        return f"backward raised {type(error).__name__}: {_first_line(error)} [{placements}]"
    for index, (reference_leaf, gradient) in enumerate(zip(reference_leaves, gradients)):
        expected_gradient = reference_leaf.grad
        if expected_gradient is None and gradient is None:
            continue
        if expected_gradient is None:
            expected_gradient = torch.zeros_like(gradient)
        if gradient is None:
            gradient = torch.zeros_like(expected_gradient)
        reason = _compare(f"grad of input {index}", gradient, expected_gradient)
        if reason:
            return f"{reason} [{placements}]"
    return ""


def _detached(arguments):
    return tree_map(lambda value: value.detach().clone() if isinstance(value, torch.Tensor) else value, arguments)


def _check_inplace_sample(library: _Library, mesh, info, sample, chooser: random.Random, partial: bool) -> str | None:
    """The in-place variant: the mutated input's value, and the input itself as the result."""
    arguments = _detached(_arguments(sample))
    reference_arguments = _detached(arguments)
    try:
        info.inplace_variant(reference_arguments[0], *reference_arguments[1], **reference_arguments[2])
    except Exception:
        return None  # e.g. a result dtype the input cannot hold, or a broadcast input
    distributed_arguments, leaves = _distribute(library, mesh, arguments, chooser, partial)
    placements = "; ".join(str(tuple(str(p) for p in leaf.placements)) for leaf in leaves)
    target = distributed_arguments[0]
    try:
        returned = info.inplace_variant(target, *distributed_arguments[1], **distributed_arguments[2])
        actual = _gathered(library, target)
    except Exception as error:
        return f"in-place raised {type(error).__name__}: {_first_line(error)} [{placements}]"
    if returned is not target:
        return f"in-place returned a {type(returned).__name__}, not its input [{placements}]"
    reason = _compare("mutated input", actual, reference_arguments[0])
    return f"{reason} [{placements}]" if reason else ""


def _out_tensors(library: _Library, mesh, expected, chooser: random.Random):
    """`out=` tensors like `expected` (a tensor or a tuple of them), sentinel-filled, random placements."""
    def convert(value):
        placements = _random_placements(library, value, mesh.ndim, chooser)
        return library.distribute_tensor(torch.full_like(value, OUT_SENTINEL), mesh, placements)

    if isinstance(expected, torch.Tensor):
        return convert(expected)
    return type(expected)(convert(value) for value in expected)


def _check_out_sample(library: _Library, mesh, info, sample, chooser: random.Random, partial: bool) -> str | None:
    """The `out=` variant: the out tensors' values and the returned values."""
    arguments = _detached(_arguments(sample))
    try:
        with torch.no_grad():
            expected = _call(info, _detached(arguments))
        if not isinstance(expected, torch.Tensor) and not (
            isinstance(expected, tuple) and all(isinstance(value, torch.Tensor) for value in expected)
        ):
            return None
        reference_out = tree_map(torch.empty_like, expected)
        sample_input, args, kwargs = _detached(arguments)
        # What the op returns (`out`, or None for ops writing a list of tensors).
        reference_returned = tree_flatten(info.op(sample_input, *args, **kwargs, out=reference_out))[0]
    except Exception:
        return None
    distributed_arguments, leaves = _distribute(library, mesh, arguments, chooser, partial)
    out = _out_tensors(library, mesh, expected, chooser)
    placements = "; ".join(str(tuple(str(p) for p in leaf.placements)) for leaf in [*leaves, *tree_flatten(out)[0]])
    try:
        sample_input, args, kwargs = distributed_arguments
        returned = tree_flatten(info.op(sample_input, *args, **kwargs, out=out))[0]
        written = [_gathered(library, value) for value in tree_flatten(out)[0]]
        returned = [_gathered(library, value) for value in returned]
    except Exception as error:
        return f"out= raised {type(error).__name__}: {_first_line(error)} [{placements}]"
    if len(returned) != len(reference_returned):
        return f"out= returned {len(returned)} values, expected {len(reference_returned)} [{placements}]"
    for what, values, expected_values in (("out", written, tree_flatten(reference_out)[0]),
                                          ("returned", returned, reference_returned)):
        for index, (value, expected_value) in enumerate(zip(values, expected_values)):
            reason = _compare(f"{what} {index}", value, expected_value)
            if reason:
                return f"{reason} [{placements}]"
    return ""


_SAMPLE_CHECKS = {"plain": _check_sample, "inplace": _check_inplace_sample, "out": _check_out_sample}


def variant_key(key: str, variant: str) -> str:
    """How results name an OpInfo's variant: `add`, `add:inplace`, `add:out`."""
    return key if variant == "plain" else f"{key}:{variant}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def check_op(library_name: str, mesh, key: str, max_samples: int = 4, variant: str = "plain",
             partial: bool = False) -> OpResult:
    """Run one OpInfo's samples on `mesh` (call on every rank); the result is the same on every rank."""
    library = _library(library_name)
    info = _database()[key]
    name = key
    key = variant_key(key, variant)
    if info.name in UNINITIALIZED:
        return OpResult(key, "skipped", "output is uninitialized memory")
    if variant == "inplace" and info.inplace_variant is None:
        return OpResult(key, "skipped", "no in-place variant")
    if variant == "out" and not info.supports_out:
        return OpResult(key, "skipped", "no out= variant")
    samples = _samples(info, max_samples)
    chooser = random.Random(_seed(f"{name}/{tuple(mesh.shape)}"))
    fallbacks_before = library.fallbacks()
    checked = 0
    for sample in samples:
        if _is_random(info, _arguments(sample)):
            return OpResult(key, "skipped", "draws random numbers (see tests/test_random.py)", checked)
        torch.manual_seed(0)
        try:
            reason = _SAMPLE_CHECKS[variant](library, mesh, info, sample, chooser, partial)
        except _Refused as refusal:
            return OpResult(key, "refused", str(refusal), checked + 1)
        if reason is None:
            continue
        checked += 1
        if reason:
            return OpResult(key, "failing", reason, checked)
    if checked == 0:
        return OpResult(key, "skipped", "no sample input runs on a single CPU device", 0)
    fallen_back = sorted((library.fallbacks() - fallbacks_before).keys())
    if fallen_back:
        return OpResult(key, "fallback", "replicate fallback for " + ", ".join(fallen_back), checked)
    return OpResult(key, "native", "", checked)


def _check_op_on_shape(library_name: str, mesh_shape: tuple[int, ...], key: str, max_samples: int,
                       variant: str = "plain", partial: bool = False) -> OpResult:
    """Worker entry point: build (or reuse) the mesh of this shape and check one op on it."""
    warnings.simplefilter("ignore")  # deprecation notes of the ops under test, once per rank
    return check_op(library_name, _mesh(_library(library_name), mesh_shape), key, max_samples, variant, partial)


# --- the driver ------------------------------------------------------------------------------------------
def _worse(first: OpResult | None, second: OpResult) -> OpResult:
    if first is None or STATUS_ORDER[second.status] > STATUS_ORDER[first.status]:
        return second
    return first


def sweep(library_name: str, keys: list[str], *, mesh_shapes=MESH_SHAPES, max_samples: int = 4,
          timeout: float = 60.0, progress=None, variants=("plain",), partial: bool = False) -> dict[str, OpResult]:
    """Check every op on `WORLD_SIZE` local ranks for each mesh shape; an op gets its worst status.

    Results are keyed by `variant_key(key, variant)` for each of `variants`.

    One task per (mesh shape, op): a rank that raises outside the harness or hangs fails only that
    op (the pool restarts), and ranks that disagree restart the pool too, since their collectives
    may no longer line up.
    """
    import shardtensor.launch as launch

    results: dict[str, OpResult] = {}
    with launch.LocalWorkers(WORLD_SIZE, timeout=timeout) as workers:
        for mesh_shape in mesh_shapes:
            for key, variant in [(key, variant) for key in keys for variant in variants]:
                mesh_text = "x".join(str(size) for size in mesh_shape)
                result_key = variant_key(key, variant)
                try:
                    per_rank = workers.run(_check_op_on_shape, library_name, mesh_shape, key, max_samples, variant, partial)
                except launch.RankFailure as failure:
                    lines = [line for line in str(failure).splitlines() if line.strip()]
                    result = OpResult(result_key, "failing", f"mesh {mesh_text}: ranks crashed or hung: {lines[-1][:200]}")
                else:
                    result = per_rank[0]
                    if any(other != result for other in per_rank[1:]):
                        workers.close()
                        result = OpResult(result_key, "failing", f"mesh {mesh_text}: ranks disagree: {per_rank}")
                    elif result.status == "failing":
                        result = dataclasses.replace(result, reason=f"mesh {mesh_text}: {result.reason}")
                results[result_key] = _worse(results.get(result_key), result)
                if progress is not None:
                    progress(mesh_shape, result)
    return results


def summary_line(results: dict[str, OpResult]) -> str:
    counted = [r for r in results.values() if r.status != "skipped"]
    statuses = ("native", "fallback", "refused", "failing")
    count = {status: sum(r.status == status for r in counted) for status in statuses}
    return (f"ops: {len(counted)} total, {count['native']} natively sharded, {count['fallback']} via fallback, "
            f"{count['refused']} refused up front, {count['failing']} failing ({len(results) - len(counted)} skipped)")


def _print_result(mesh_shape: tuple[int, ...], result: OpResult) -> None:
    print(f"{'x'.join(map(str, mesh_shape)):>4} {result.status:8} {result.key} {result.reason}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", choices=["shardtensor", "torch"], default="shardtensor")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo keys (default: all)")
    parser.add_argument("--max-samples", type=int, default=4, help="sample inputs per op (default 4)")
    parser.add_argument("--meshes", default="4,2x2", help="mesh shapes of 4 ranks, e.g. '4,2x2'")
    parser.add_argument("--verbose", action="store_true", help="print each op as it finishes")
    parser.add_argument("--variants", default="plain",
                        help="comma-separated: plain (the function, with gradients), inplace, out (default: plain)")
    parser.add_argument("--partial", action="store_true", help="make floating inputs Partial(sum) on a mesh dim")
    options = parser.parse_args(argv)
    keys = op_keys()
    if options.ops:
        wanted = [key.strip() for key in options.ops.split(",") if key.strip()]
        unknown = [key for key in wanted if key not in keys]
        if unknown:
            parser.error(f"unknown OpInfo keys {unknown}; keys are OpInfo names, with '.variant' where one exists")
        keys = wanted
    mesh_shapes = [tuple(int(size) for size in text.split("x")) for text in options.meshes.split(",")]
    variants = tuple(variant.strip() for variant in options.variants.split(",") if variant.strip())
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants {options.variants!r}: choose among {', '.join(VARIANTS)}")
    progress = _print_result if options.verbose else None
    start = time.perf_counter()
    results = sweep(options.library, keys, mesh_shapes=mesh_shapes, max_samples=options.max_samples, progress=progress,
                    variants=variants, partial=options.partial)
    inputs = "Partial inputs" if options.partial else "Shard/Replicate inputs"
    print(f"library {options.library}, meshes {options.meshes}, {inputs}, {time.perf_counter() - start:.0f} s")
    for variant in variants:
        chosen = {key: result for key, result in results.items() if key == variant_key(key.partition(":")[0], variant)}
        print(f"{variant:>7}: {summary_line(chosen)}")
    for status in ("failing", "fallback", "refused", "skipped"):
        chosen = sorted(r.key for r in results.values() if r.status == status)
        print(f"\n{status} ({len(chosen)}):")
        for key in chosen:
            reason = results[key].reason
            print(f"  {key}" + (f": {reason}" if reason else ""))
    return 0


if __name__ == "__main__":
    import opinfo_sweep  # the workers import the module by this name, not as __main__

    sys.exit(opinfo_sweep.main())
