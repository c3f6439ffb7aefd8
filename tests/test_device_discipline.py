"""Device discipline (issue 12 item 3): the library creates every tensor on the device of the data it
belongs to, and its collectives refuse tensors on a device the mesh's backend cannot use. There is no
GPU here, so three kinds of test stand in for a CUDA run:

1. A static scan of src/shardtensor (the `ast` module): every call of a torch factory (`FACTORIES`)
   names a device, no `device` parameter defaults to the CPU, and every tensor made on the CPU (any
   call with `device="cpu"`) or moved to the host (`.cpu()`, `.numpy()`, `.to("cpu")`) is in
   `ALLOWED`, each with its reason. It proves what
   the source says, for every line, run or not; it cannot see a factory reached under another name
   (`getattr(torch, name)`), nor whether a `device=` expression is the right device.
2. A recording run: a representative program (redistribute of each kind, ops, random init,
   fully_shard forward, backward and optimizer step, full state dicts) under a torch-function mode that
   records each factory and each `.cpu()`/`.numpy()` called directly from library code, re-entered at
   the library's `__torch_function__`/`__torch_dispatch__` (torch pops a mode while it runs, hiding
   what runs below). Every recorded factory must pass `device=` explicitly, wherever it was called
   from and however it was named, and every move to the host must be in `ALLOWED`. On the CPU every
   device is `cpu`, so it cannot tell `device=x.device` from `device="cpu"` (the scan does); it sees
   only the paths the program runs, and only calls made by library code itself (a torch function that
   the library calls is trusted to follow its inputs' device).
3. Ops on CPU DTensors with PyTorch's default device set to `meta`: a tensor made without `device=`
   lands on meta and fails (or gives a meta result) instead of silently working as it would on a
   CPU-only machine. `torch.set_default_device` is a torch-function mode too, so the library's
   `__torch_dispatch__` is also run inside it (patched here for the block). Values are compared with
   the single-device results computed before the default device changes.
"""

import ast
import contextlib
import dataclasses
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import exact_full, partial_and_value, sharded_leaf
from spmd import spmd
from test_fsdp import _assert_same_parameters, _batches, _local_batch, _loss, _model, _shard, _train_reference
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.overrides import TorchFunctionMode

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor
from shardtensor.checkpoint import get_model_state_dict, set_model_state_dict
from shardtensor.fsdp import api as fsdp_api
from shardtensor.ops.resample_geometry import interpolation_taps

MESHES = [(1,), (2,)]


# --- 1. The static scan --------------------------------------------------------------------------

SOURCE = pathlib.Path(shardtensor.__file__).parent

# torch functions that make a new tensor and take `device=`. `*_like` and `Tensor.new_*` are not here:
# they take the device of the tensor they are given.
FACTORIES = frozenset((
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "asarray", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor",
    "tril_indices", "triu_indices", "frombuffer", "from_numpy",
))
NO_DEVICE, ON_CPU, TO_HOST = "no device", "cpu", "to host"

_HOST_METADATA = "host metadata: rank tables, as torch's DeviceMesh.mesh, read with .tolist(); no data lives in them"
_DEMO_TEXT = "the demo's text: host data, whose batches train.py moves to the mesh's device"
# (path under src/shardtensor, enclosing function or "*" for every function of the file, kind) -> why.
# Every finding of the scan must be here, and every entry must still match a finding.
ALLOWED = {
    ("mesh.py", "DeviceMesh.__init__", ON_CPU): _HOST_METADATA,
    ("mesh.py", "DeviceMesh.from_group", ON_CPU): _HOST_METADATA,
    ("mesh.py", "_rebuild_mesh", ON_CPU): _HOST_METADATA,
    ("mesh.py", "init_device_mesh", ON_CPU): _HOST_METADATA,
    ("fsdp/slots.py", "combined_mesh", ON_CPU): _HOST_METADATA,
    ("random.py", "next_random_call", ON_CPU):
        "the world's seed: one draw from torch's default CPU generator, read as a Python int and shared",
    ("random.py", "_Tiles.draw", ON_CPU):
        "random tiles are drawn by a CPU generator whatever the data's device, so that every device gets the "
        "same numbers; _fill_box copies each tile into the shard on its own device",
    ("ops/resample_geometry.py", "*", ON_CPU):
        "interpolation taps: arithmetic on global sizes, cached across devices and read on the host to plan "
        "the exchanges; spatial_resample moves the rows it applies to the data's device",
    ("comm/objects.py", "_pickled", NO_DEVICE):
        "torch.frombuffer takes no device: the pickled bytes are moved to the mesh's device on the same line",
    ("comm/objects.py", "_gather_objects", TO_HOST): "the received pickles are unpickled from host memory",
    ("comm/objects.py", "broadcast_object", TO_HOST): "the received pickle is unpickled from host memory",
    ("comm/objects.py", "share_object", TO_HOST): "the received pickle is unpickled from host memory",
    ("comm/objects.py", "_unpickled", TO_HOST): ".numpy() of the bytes that all three just moved to the host",
    ("checkpoint.py", "_converted", TO_HOST): "StateDictOptions(cpu_offload=True) asks for CPU state dicts",
    ("demo/data.py", "Corpus.encode", ON_CPU): _DEMO_TEXT,
    ("demo/data.py", "load_corpus", ON_CPU): _DEMO_TEXT,
    ("demo/data.py", "batch_for_step", ON_CPU): "batch windows drawn by a CPU generator (the same on every rank)",
    ("demo/checkpoint.py", "save_checkpoint", ON_CPU): "the step count, a plain scalar saved beside the states",
    ("demo/checkpoint.py", "load_checkpoint", ON_CPU): "the step count, a plain scalar loaded beside the states",
    ("demo/forecast.py", "make_step", NO_DEVICE):
        "the forecast's one fake rank runs on a CPU mesh (forecast/fake_world.py); token windows drawn by a CPU generator",
    ("demo/pipeline_train.py", "_whole_model", TO_HOST):
        "the trained weights gathered into one host model, whose text sample is drawn on the CPU (demo/report.generate)",
    ("demo/report.py", "generate", TO_HOST):
        "sampled by torch.multinomial with a CPU generator: the same text on every rank",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """A factory call without a device or on the CPU, a `device` parameter defaulting to the CPU, or a
    move to the host."""

    path: str
    function: str  # qualified name of the enclosing function, "<module>" at top level
    kind: str
    line: int
    text: str

    def allowed(self) -> tuple | None:
        for key in ((self.path, self.function, self.kind), (self.path, "*", self.kind)):
            if key in ALLOWED:
                return key
        return None


def _is_cpu(node, constants: dict) -> bool:
    """Whether an expression names the CPU: "cpu", torch.device("cpu"), or a module constant set to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device" and node.args:
        return _is_cpu(node.args[0], constants)
    if isinstance(node, ast.Name) and node.id in constants:
        return _is_cpu(constants[node.id], constants)
    return False


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.Module):
        self.path, self.scope, self.findings = path, [], []
        self.constants = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                          for target in node.targets if isinstance(target, ast.Name)}
        self.from_torch = {alias.asname or alias.name: alias.name for node in tree.body
                           if isinstance(node, ast.ImportFrom) and node.module == "torch" for alias in node.names}

    def _add(self, node, kind: str) -> None:
        self.findings.append(Finding(self.path, ".".join(self.scope) or "<module>", kind, node.lineno, ast.unparse(node)))

    def _in_scope(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = _in_scope

    def visit_FunctionDef(self, node) -> None:
        arguments = node.args
        positional = arguments.posonlyargs + arguments.args
        defaults = list(zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults))
        defaults += [pair for pair in zip(arguments.kwonlyargs, arguments.kw_defaults) if pair[1] is not None]
        self.scope.append(node.name)  # a parameter's default counts as its function's
        for argument, default in defaults:
            if argument.arg == "device" and _is_cpu(default, self.constants):
                self._add(default, ON_CPU)
        self.scope.pop()
        self._in_scope(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node) -> None:
        function = node.func
        name = None
        if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name) and function.value.id == "torch":
            name = function.attr
        elif isinstance(function, ast.Name):
            name = self.from_torch.get(function.id)
        device = next((keyword.value for keyword in node.keywords if keyword.arg == "device"), None)
        if isinstance(function, ast.Attribute) and self._moves_to_host(function.attr, node):
            self._add(node, TO_HOST)
        elif name in FACTORIES and device is None:
            self._add(node, NO_DEVICE)
        elif device is not None and _is_cpu(device, self.constants):  # a factory, `new_*`, `*_like`...
            self._add(node, ON_CPU)
        self.generic_visit(node)

    def _moves_to_host(self, method: str, node: ast.Call) -> bool:
        if method in ("cpu", "numpy"):
            return not node.args and all(keyword.arg == "force" for keyword in node.keywords)
        if method == "to":
            targets = node.args[:1] + [keyword.value for keyword in node.keywords if keyword.arg == "device"]
            return any(_is_cpu(target, self.constants) for target in targets)
        return False


def scan(source: str, path: str = "<string>") -> list[Finding]:
    tree = ast.parse(source)
    scanner = _Scanner(path, tree)
    scanner.visit(tree)
    return scanner.findings


def test_the_scan_finds_factories_without_a_device_cpu_devices_and_moves_to_the_host():
    source = """
from torch import zeros as make_zeros
HOST = torch.device("cpu")
def f(x, device="cpu"):
    a = torch.empty(3)
    b = torch.zeros(2, device=x.device)
    c = make_zeros(2)
    d = torch.full((), 1, device=HOST)
    e = x.new_zeros(3), torch.ones_like(x), x.to(x.device), x.to(torch.float64)
    return x.cpu(), x.to("cpu"), x.detach().numpy(), x.to(device="cpu", dtype=torch.float64)
class C:
    def g(self, mesh, x):
        return torch.arange(4, device=mesh.device_type), torch.tensor(1, device="cpu:0"), x.new_ones(2, device=HOST)
"""
    found = [(finding.function, finding.kind, finding.line) for finding in scan(source)]
    assert found == [
        ("f", ON_CPU, 4), ("f", NO_DEVICE, 5), ("f", NO_DEVICE, 7), ("f", ON_CPU, 8),
        ("f", TO_HOST, 10), ("f", TO_HOST, 10), ("f", TO_HOST, 10), ("f", TO_HOST, 10),
        ("C.g", ON_CPU, 13), ("C.g", ON_CPU, 13),
    ]


def test_every_factory_in_the_library_names_a_device_and_every_cpu_one_is_allowed_with_a_reason():
    findings = [finding for file in sorted(SOURCE.rglob("*.py"))
                for finding in scan(file.read_text(), file.relative_to(SOURCE).as_posix())]
    refused = [finding for finding in findings if finding.allowed() is None]
    assert not refused, "tensors made without the data's device (pass device=, or allow with a reason):\n" + "\n".join(
        f"  {finding.path}:{finding.line} in {finding.function}: {finding.kind}: {finding.text}" for finding in refused)
    stale = set(ALLOWED) - {finding.allowed() for finding in findings}
    assert not stale, f"allowed sites that the scan no longer finds (remove them): {sorted(stale)}"
    assert len(findings) >= len(ALLOWED) and all(ALLOWED.values())


# --- 2. The recording run ------------------------------------------------------------------------

_RECORDED = {getattr(torch, name): name for name in FACTORIES}
_RECORDED.update({torch.Tensor.cpu: "Tensor.cpu", torch.Tensor.numpy: "Tensor.numpy"})


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """A factory or move to the host that library code called, as the recording mode saw it."""

    function: str  # the torch function
    path: str  # the calling library file, under src/shardtensor
    caller: str  # the calling function's qualified name
    device: object  # the `device=` argument, or NO_DEVICE when the call passed none

    def allowed(self) -> bool:
        kind = TO_HOST if self.function.startswith("Tensor.") else NO_DEVICE
        return self.device is not NO_DEVICE or any(
            key in ALLOWED for key in ((self.path, self.caller, kind), (self.path, "*", kind)))


class _LibraryCalls(TorchFunctionMode):
    """Records the factories and moves to the host that library code calls directly (the calling frame
    is in src/shardtensor), with the `device=` they pass; torch's own calls are torch's business."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _RECORDED.get(func)
        if name is not None:
            caller = sys._getframe(1).f_code  # a torch function in C is called right from the library's frame
            path = pathlib.Path(caller.co_filename)
            if path.is_relative_to(SOURCE):
                device = kwargs.get("device", NO_DEVICE)
                self.calls.append(Call(name, path.relative_to(SOURCE).as_posix(), caller.co_qualname, device))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _recording(calls: list):
    """`_LibraryCalls` around the block and again inside every entry of torch into the library."""

    def reentered(entry):
        def run(cls, *args, **kwargs):
            with _LibraryCalls(calls):
                return entry(*args, **kwargs)

        return classmethod(run)

    entries = {name: shardtensor.DTensor.__dict__[name] for name in ("__torch_function__", "__torch_dispatch__")}
    bound = {name: getattr(shardtensor.DTensor, name) for name in entries}
    try:
        for name in entries:
            setattr(shardtensor.DTensor, name, reentered(bound[name]))
        with _LibraryCalls(calls):
            yield
    finally:
        for name, entry in entries.items():
            setattr(shardtensor.DTensor, name, entry)


def _assert_every_call_names_a_device(calls: list, expected_sites: set) -> None:
    """Every recorded call passed `device=` (or is allowed), and the recording saw `expected_sites`
    ((path, caller) pairs that the program must reach: proof that the mode saw below torch)."""
    refused = sorted({call for call in calls if not call.allowed()}, key=str)
    assert not refused, "library calls without device= (or not allowed):\n" + "\n".join(f"  {call}" for call in refused)
    missing = expected_sites - {(call.path, call.caller) for call in calls}
    assert not missing, f"the recording did not see {sorted(missing)}; it saw {sorted({(c.path, c.caller) for c in calls})}"


@spmd(meshes=[(2,)])
def test_redistributions_of_every_kind_name_the_device_of_what_they_make(mesh):
    full = exact_full((5, 6))
    calls = []
    partial, value = partial_and_value(mesh, (5, 6))
    uneven = sharded_leaf(full, mesh, [Shard(0)], shard_sizes={0: [4, 1]})
    cases = [
        (distribute_tensor(full, mesh, [Shard(0)]), [Replicate()], full),  # all_gather
        (distribute_tensor(full, mesh, [Replicate()]), [Shard(1)], full),  # local chunk
        (distribute_tensor(full, mesh, [Shard(0)]), [Shard(1)], full),  # all_to_all
        (uneven, [Shard(1)], full),  # uneven all_to_all
        (partial, [Replicate()], value),  # all_reduce
        (partial, [Shard(0)], value),  # reduce_scatter
    ]
    with _recording(calls):
        results = [source.redistribute(mesh, placements) for source, placements, _ in cases]
        pieces = [full[:4], full[4:]] if mesh.get_rank() == 0 else None  # an uneven scatter
        scattered = comm.scatter(pieces, mesh, 0, shape=[(4, 1)[mesh.get_rank()], 6], dtype=full.dtype)
        shapes = comm.all_gather_object(tuple(uneven.to_local().shape), mesh, 0)
    for result, (_, placements, expected) in zip(results, cases):
        assert result.placements == tuple(placements)
        torch.testing.assert_close(result.full_tensor(), expected)
    assert torch.equal(scattered, full.split([4, 1])[mesh.get_rank()]) and shapes == [(4, 6), (1, 6)]
    receiving = {("comm/collectives.py", "scatter")} if mesh.get_rank() != 0 else set()  # its receive buffer
    # (reduce_scatter's own output buffer is made on nccl only: over gloo it runs as an exchange, `comm.peers`)
    expected_sites = {("comm/objects.py", "_gather_objects")} | receiving
    _assert_every_call_names_a_device(calls, expected_sites)


@spmd(meshes=[(2,)])
def test_ops_and_random_init_name_the_device_of_what_they_make(mesh):
    full, weight = exact_full((4, 6)), exact_full((6, 3), seed=1)
    image = exact_full((1, 2, 7))
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64).log_softmax(1)
    target = torch.tensor([0, 5, 2, -100, 3])
    x = distribute_tensor(full, mesh, [Shard(0)])
    calls = []
    interpolation_taps.cache_clear()  # its tables are made once per geometry and process
    with _recording(calls):
        product = x @ distribute_tensor(weight, mesh, [Replicate()])
        total = x.sum(0)  # Partial, read below
        softmax = x.softmax(0)  # along the sharded dim
        resized = F.interpolate(distribute_tensor(image, mesh, [Shard(2)]), scale_factor=2, mode="linear")
        loss = F.nll_loss(distribute_tensor(logits, mesh, [Shard(1)]), distribute_tensor(target, mesh, [Replicate()]))
        same = torch.equal(x, distribute_tensor(full, mesh, [Shard(0)]))
        shardtensor.manual_seed(5)
        initialized = shardtensor.randn(7, 3, device_mesh=mesh, placements=[Shard(0)])
        dropped = F.dropout(x, p=0.5, training=True)
    torch.testing.assert_close(product.full_tensor(), full @ weight)
    torch.testing.assert_close(total.full_tensor(), full.sum(0))
    torch.testing.assert_close(softmax.full_tensor(), full.softmax(0))
    torch.testing.assert_close(resized.full_tensor(), F.interpolate(image, scale_factor=2, mode="linear"))
    torch.testing.assert_close(loss.full_tensor(), F.nll_loss(logits, target))
    assert same
    shardtensor.manual_seed(5)
    replicated = shardtensor.randn(7, 3, device_mesh=mesh, placements=[Replicate()])
    assert torch.equal(initialized.full_tensor(), replicated.full_tensor())
    kept = dropped.full_tensor() != 0
    assert torch.equal(dropped.full_tensor()[kept], 2 * full[kept])
    _assert_every_call_names_a_device(calls, {
        ("random.py", "random_shard"), ("ops/resample_geometry.py", "_source_coordinates"),
    })


def _backward(loss: torch.Tensor) -> None:
    """`loss.backward()` with the recording mode active in the engine (autograd functions, hooks): the
    public entries (`Tensor.backward`, `torch.autograd.backward`) are torch functions, under which torch
    pops the mode for the whole backward, so this calls the engine's entry below them (private)."""
    torch.autograd.graph._engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                              allow_unreachable=True, accumulate_grad=True)


@spmd(meshes=[(2,)])
def test_fully_shard_training_and_state_dicts_name_the_device_of_what_they_make(mesh):
    """Forward, backward, AdamW steps and full state dicts (offloaded to the CPU, and loaded), against one device."""
    batches = _batches(2)
    reference = _train_reference(_model(), batches)
    rank, ranks = mesh.get_rank(), mesh.size()
    calls = []
    with _recording(calls):
        model = _shard(_model(), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        for inputs, target in batches:
            _backward(_loss(model(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks)))
            optimizer.step()
            optimizer.zero_grad()
    _assert_same_parameters(model, reference)
    with _recording(calls):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        set_model_state_dict(model, _model().state_dict(), options=StateDictOptions(full_state_dict=True))
    expected = reference.state_dict() if rank == 0 else {}  # cpu_offload: rank 0 keeps the full state dict
    assert state.keys() == expected.keys()
    for name, value in state.items():
        assert value.device.type == "cpu" and not isinstance(value, shardtensor.DTensor)
        torch.testing.assert_close(value, expected[name], msg=name)
    _assert_same_parameters(model, _model())  # the initial values, loaded from a full state dict
    _assert_every_call_names_a_device(calls, {
        ("fsdp/unit.py", "ParameterUnit._build_buffers"), ("fsdp/reduction.py", "pack_gradients"),
        ("checkpoint.py", "_converted"),
    })


# --- 3. Ops under a meta default device ----------------------------------------------------------


_library_dispatch = shardtensor.DTensor.__dict__["__torch_dispatch__"]


@classmethod
def _dispatch_on_meta_default(cls, *args, **kwargs):
    with torch.device("meta"):
        return _library_dispatch.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def _default_device_meta():
    torch.set_default_device("meta")
    shardtensor.DTensor.__torch_dispatch__ = _dispatch_on_meta_default
    try:
        yield
    finally:
        shardtensor.DTensor.__torch_dispatch__ = _library_dispatch
        torch.set_default_device(None)


def _full(dtensor) -> torch.Tensor:
    full = dtensor.full_tensor()
    assert full.device.type == "cpu", f"a result on {full.device}: the library created a tensor without device="
    return full


@spmd(meshes=MESHES)
def test_equal_and_allclose_of_shards_make_their_flags_on_the_data_device(mesh):
    full = torch.arange(12.0).reshape(6, 2)
    other = full.clone()
    other[5, 1] = -1.0
    x, same, different = (distribute_tensor(value, mesh, [Shard(0)]) for value in (full, full.clone(), other))
    with _default_device_meta():
        answers = [torch.equal(x, same), torch.equal(x, different), torch.allclose(x, same), torch.allclose(x, different)]
    assert answers == [True, False, True, False]


@spmd(meshes=MESHES)
def test_nll_loss_of_class_sharded_logits_on_the_data_device(mesh):
    for reduction in ("none", "sum", "mean"):
        _check_nll_loss(mesh, reduction)


def _check_nll_loss(mesh, reduction):
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)).log_softmax(1)
    target = torch.tensor([0, 5, 2, -100, 3])
    weight = torch.arange(1.0, 7.0)
    expected = F.nll_loss(logits, target, weight, reduction=reduction)
    sharded = distribute_tensor(logits, mesh, [Shard(1)])
    targets = distribute_tensor(target, mesh, [Replicate()])
    weights = distribute_tensor(weight, mesh, [Replicate()])
    with _default_device_meta():
        loss = F.nll_loss(sharded, targets, weights, reduction=reduction)
        unweighted = F.nll_loss(sharded, targets, reduction=reduction)
    torch.testing.assert_close(_full(loss), expected)
    torch.testing.assert_close(_full(unweighted), F.nll_loss(logits, target, reduction=reduction))


@spmd(meshes=MESHES)
def test_embedding_with_a_vocabulary_sharded_weight_checks_indices_on_the_data_device(mesh):
    weight = torch.arange(24.0).reshape(8, 3)
    ids = torch.tensor([[0, 7, 3], [5, 5, 1]])
    x = distribute_tensor(weight, mesh, [Shard(0)])
    indices = distribute_tensor(ids, mesh, [Replicate()])
    out_of_range = distribute_tensor(torch.tensor([8]), mesh, [Replicate()])
    with _default_device_meta():
        out = F.embedding(indices, x)
        with pytest.raises(IndexError):
            F.embedding(out_of_range, x)
    assert torch.equal(_full(out), F.embedding(ids, weight))


@spmd(meshes=MESHES)
def test_random_ops_draw_on_the_data_device_and_do_not_depend_on_the_layout(mesh):
    """Each random op twice from the same seed, sharded and replicated: the same global numbers."""
    full = torch.arange(1.0, 13.0).reshape(6, 2)
    results = {}
    for name, placements in (("sharded", [Shard(0)]), ("replicated", [Replicate()])):
        x = distribute_tensor(full, mesh, placements)
        shardtensor.manual_seed(7)
        with _default_device_meta():
            dropped = F.dropout(x, p=0.5, training=True)
            coins = torch.bernoulli(x / 13.0)
            normal = torch.normal(x, 1.0)
            x_copy = x.clone()
            x_copy.uniform_(-1.0, 1.0)
        results[name] = [_full(value) for value in (dropped, coins, normal, x_copy)]
    for sharded, replicated in zip(results["sharded"], results["replicated"]):
        assert torch.equal(sharded, replicated)
    dropped = results["sharded"][0]
    assert torch.equal(dropped[dropped != 0], 2 * full[dropped != 0])  # kept values scaled by 1 / (1 - p)


@spmd(meshes=MESHES)
def test_attention_on_a_rank_without_heads_makes_its_results_on_the_data_device(mesh):
    """One head on 2 ranks: the rank without it builds empty results (`ops/attention.py`) instead of
    calling the kernel, forward and backward."""
    fulls = [torch.randn(2, 1, 3, 4, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    leaves = [distribute_tensor(full, mesh, [Shard(1)]).requires_grad_() for full in fulls]
    references = [full.clone().requires_grad_() for full in fulls]
    grad_full = torch.randn(2, 1, 3, 4, generator=torch.Generator().manual_seed(3))
    grad = distribute_tensor(grad_full, mesh, [Shard(1)])
    with _default_device_meta():
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.backward(grad)
    expected = F.scaled_dot_product_attention(*references, is_causal=True)
    expected.backward(grad_full)
    torch.testing.assert_close(_full(out), expected)
    for leaf, reference in zip(leaves, references):
        torch.testing.assert_close(_full(leaf.grad), reference.grad)


@spmd(meshes=MESHES)
def test_meshes_and_redistribute_under_a_meta_default_device(mesh):
    full = torch.arange(10.0).reshape(5, 2)
    with _default_device_meta():
        again = shardtensor.init_device_mesh("cpu", mesh.shape)
        x = distribute_tensor(full, again, [Shard(0)])
        y = x.redistribute(again, [Replicate()])
    assert x.to_local().device.type == "cpu" and torch.equal(_full(y), full)


@spmd(meshes=MESHES)
def test_a_collective_refuses_a_tensor_on_another_device_naming_both(mesh):
    for collective in (
        lambda tensor: comm.all_reduce(tensor, mesh, 0, reduce_op="sum"),
        lambda tensor: comm.all_gather(tensor, mesh, 0, dim=0, sizes=[2] * mesh.size()),
        lambda tensor: comm.broadcast(tensor, mesh, 0),
    ):
        with pytest.raises(ValueError, match=r"on device meta .*device type 'cpu'"):
            collective(torch.ones(2, device="meta"))
    assert torch.equal(comm.all_reduce(torch.ones(2), mesh, 0, reduce_op="sum"), torch.full((2,), float(mesh.size())))


@spmd(meshes=[(1,)])
def test_distribute_tensor_keeps_a_meta_tensor_on_meta(mesh):
    x = distribute_tensor(torch.empty(4, 2, device="meta"), mesh, [Shard(0)])
    assert x.to_local().device.type == "meta" and x.shape == (4, 2)


@spmd(meshes=MESHES)
def test_interpolate_of_a_spatially_sharded_tensor_reads_its_taps_on_the_host(mesh):
    """The tap tables are host metadata (`resample_geometry`): made on the default device, they were meta
    here and reading them to plan the exchange failed."""
    image = exact_full((1, 2, 7))
    x = distribute_tensor(image, mesh, [Shard(2)])
    interpolation_taps.cache_clear()  # made once per geometry and process: make them under the meta default
    with _default_device_meta():
        linear = F.interpolate(x, scale_factor=2, mode="linear")
        nearest = F.interpolate(x, size=10, mode="nearest")
    torch.testing.assert_close(_full(linear), F.interpolate(image, scale_factor=2, mode="linear"))
    assert torch.equal(_full(nearest), F.interpolate(image, size=10, mode="nearest"))


@pytest.mark.parametrize(("parameters", "backend", "cuda_available", "expected"), [
    ("cpu", None, True, "cpu"),  # where the parameters are, whatever the machine has
    ("meta", None, False, "cpu"),
    ("meta", None, True, "cuda"),  # a model to materialize later: the accelerator, as FSDP2
    ("meta", "nccl", False, "cuda"),  # the world's backend decides once there is one
    ("meta", "gloo", True, "cpu"),
])
def test_fully_shard_without_a_mesh_makes_one_for_the_device_of_the_parameters(
        monkeypatch, parameters, backend, cuda_available, expected):
    monkeypatch.setattr(fsdp_api.dist, "is_initialized", lambda: backend is not None)
    monkeypatch.setattr(fsdp_api.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(fsdp_api.torch.cuda, "is_available", lambda: cuda_available)
    assert fsdp_api._default_device_type([torch.nn.Linear(2, 3, device=parameters)]) == expected
