"""The shape of the code: imports only go down the layers (no cycle, counting imports inside
functions), and `DTensor` is complete when its class statement ends (running ops adds nothing to it).

Both run in a fresh Python process: the test process has long since imported everything and run ops.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import shardtensor

SOURCE = pathlib.Path(shardtensor.__file__).parent

# The layers of ../shared/DESIGN.md, lowest first: a module may import its own layer and the ones
# below. Each entry is a module name relative to `shardtensor` ("ops" covers "ops.*"). Modules not
# listed (new packages) are checked for cycles only.
LAYERS = [
    ["graph_constants"],  # how torch.compile holds the value types below (torch's opaque objects)
    ["placement"],
    ["layout"],
    ["rank_state", "process_groups", "simulated_world", "mesh_slicing", "mesh", "launch"],  # simulated_world: in-memory groups for launch.simulate
    ["comm", "halo"],  # halo: point-to-point window exchange built on comm, for spatially sharded ops
    ["redistribute", "random", "log"],
    ["modes", "rules", "row_costs", "propagation", "ops"],  # rules, their costs, the decisions made from them,
    # and the switches rules read
    ["handlers", "torch_exchange",  # users' handlers (read by dispatch, torch_function), PyTorch's DTensor
     "spec", "plain_tensors", "write_back", "input_moves", "plan_cache", "list_plans", "dispatch", "gradients",
     "torch_function", "tensor_methods", "from_local", "autograd", "checkpoint"],  # the engine below the class, and the mixins it inherits
    ["dtensor", "api", "scatter"],
    ["debug", "experimental", "parallel", "fsdp", "forecast", ""],  # "": the package's `__init__`, which exports it all
    ["demo"],  # the main job, built on the public API
]


def _module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in SOURCE.rglob("*.py"):
        if path.name == "__main__.py":  # a program (`python -m shardtensor.demo`): importing it runs it
            continue
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """Every shardtensor module that `name` imports, at the top or inside a function. `from . import x`
    imports the module `x`, not the package's `__init__` (which ran before `name` anyway)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in modules and module != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None (depth-first search, colouring the modules)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def _layer(name: str) -> int | None:
    relative = name.removeprefix("shardtensor").removeprefix(".")
    for number, layer in enumerate(LAYERS):
        for entry in layer:
            if relative == entry or (entry and relative.startswith(entry + ".")):
                return number
    return None


def test_every_module_imports_in_a_fresh_process_and_the_import_graph_has_no_cycle():
    modules = _module_names()
    program = textwrap.dedent(f"""
        import importlib, json, sys
        for name in {sorted(modules)!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(name for name in sys.modules if name.startswith("shardtensor"))))
    """)
    imported = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert set(json.loads(imported.stdout.splitlines()[-1])) >= set(modules)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    upward = [
        f"{name} (layer {_layer(name)}) imports {imported} (layer {_layer(imported)})"
        for name, imports in graph.items() for imported in imports
        if _layer(name) is not None and _layer(imported) is not None and _layer(imported) > _layer(name)
    ]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


# Libraries src/ never imports (DESIGN.md's ground rules): PyTorch's own DTensor stack and PhysicsNeMo.
_FORBIDDEN = ("torch.distributed.tensor", "torch.distributed.device_mesh", "torch.distributed._tensor",
              "torch.distributed.fsdp", "physicsnemo")
# The one exception: the exchange with PyTorch's DTensor (`DTensor.from_dtensor` / `to_dtensor`) must
# build and read torch's DTensors and meshes; it imports them lazily, inside its functions only.
_LAZY_EXCEPTION = "shardtensor.torch_exchange"


def _forbidden_imports(name: str, path: pathlib.Path) -> list[str]:
    """Each import of a forbidden library in a module, with where it is (`top level` or `in a function`)."""
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            sources = []
            if isinstance(child, ast.ImportFrom) and not child.level:
                sources = [child.module or ""] + [f"{child.module}.{alias.name}" for alias in child.names]
            elif isinstance(child, ast.Import):
                sources = [alias.name for alias in child.names]
            for source in sources:
                if any(source == banned or source.startswith(banned + ".") for banned in _FORBIDDEN):
                    found.append((source, "in a function" if inside else "at top level"))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return [f"{name}: {source} {where}" for source, where in dict.fromkeys(found)]


def test_src_imports_no_torch_dtensor_stack_except_lazily_in_the_exchange():
    modules = _module_names()
    found = {name: _forbidden_imports(name, path) for name, path in modules.items()}
    lazy = found.pop(_LAZY_EXCEPTION)
    assert lazy and all(line.endswith("in a function") for line in lazy), lazy
    assert not [line for lines in found.values() for line in lines]


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


_RUN_OPS = """
import json, torch
import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

def snapshot():
    return {name: id(value) for name, value in vars(DTensor).items()}

before = snapshot()
mesh = init_device_mesh("cpu", (1,))
x = distribute_tensor(torch.randn(4, 6, requires_grad=True), mesh, [Shard(0)])
y = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
z = (x + y) * 2.5 @ y.t()                          # operators, torch_function fast path
w = torch.nn.functional.gelu(x).sum(0).view(2, 3)  # public functions, views
w.sum().backward()                                 # autograd through DTensor ops
p = DTensor.from_local(torch.ones(3), mesh, [Partial()])
q = (p * 3).redistribute(mesh, [Replicate()]).full_tensor()
x.detach().clone().add_(1).t_()                     # in-place, in-place views
torch.cumsum(y, 0); y[1:, ::2]; x.shape; x.size(); x.dtype  # fallback or rules, indexing, metadata
after = snapshot()
print(json.dumps({"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
                  "replaced": sorted(name for name in before if name in after and before[name] != after[name])}))
"""


def test_dtensor_class_is_the_same_before_and_after_running_ops():
    """`vars(DTensor)` right after `import shardtensor` equals `vars(DTensor)` after ops of every kind."""
    result = subprocess.run([sys.executable, "-c", _RUN_OPS], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.splitlines()[-1]) == {"added": [], "removed": [], "replaced": []}
