"""CommDebugMode: exact collective counts and bytes for redistributes, ops and modules (forward and
backward), fallbacks, plans, the tracing table and its JSON."""

import json
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from helpers import layout_box, seeded_randn
from spmd import spmd
from torch.testing import assert_close

from shardtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, comm, distribute_module, distribute_tensor
from shardtensor.debug.comm_mode import C10D_NAMES, OUTSIDE_OPS, CommBytes, CommDebugMode
from shardtensor.experimental import context_parallel, context_parallel_unshard, set_rotate_method
from shardtensor.layout import Layout
from shardtensor.redistribute import CostModel, execute, plan

ONE_D = [(1,), (2,), (4,)]
FLOAT = 4  # bytes per float32 element


@spmd(meshes=ONE_D)
def test_shard_to_replicate_is_one_all_gather_with_exact_bytes(mesh):
    ranks = mesh.size()
    x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        full = x.full_tensor()
    assert torch.equal(full, torch.arange(32.0).reshape(8, 4))
    if ranks == 1:
        assert mode.get_total_counts() == 0 and mode.get_comm_counts() == {}
        return
    moved = (8 // ranks) * 4 * FLOAT * (ranks - 1)
    assert mode.get_total_counts() == 1
    assert mode.get_comm_counts() == {"all_gather": 1}
    assert mode.get_comm_bytes() == {"all_gather": CommBytes(moved, moved)}
    assert mode.get_total_bytes() == CommBytes(moved, moved)
    assert mode.get_comm_counts_by_op() == {OUTSIDE_OPS: {"all_gather": 1}}


@spmd(meshes=ONE_D)
def test_partial_to_replicate_is_one_all_reduce_with_ring_bytes(mesh):
    ranks = mesh.size()
    partial = DTensor.from_local(torch.ones(8, 4), mesh, [Partial()])
    with CommDebugMode() as mode:
        total = partial.redistribute(placements=[Replicate()])
    assert torch.equal(total.to_local(), torch.full((8, 4), float(ranks)))
    if ranks == 1:
        assert mode.get_total_counts() == 0
        return
    ring = 2 * (ranks - 1) * 8 * 4 * FLOAT // ranks
    assert mode.get_comm_counts() == {"all_reduce": 1}
    assert mode.get_comm_bytes() == {"all_reduce": CommBytes(ring, ring)}


@spmd(meshes=[(2,), (4,)])
def test_shard_to_other_shard_is_one_all_to_all_moving_only_foreign_pieces(mesh):
    ranks = mesh.size()
    x = distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        y = x.redistribute(placements=[Shard(1)])
    assert torch.equal(y.full_tensor(), torch.arange(64.0).reshape(8, 8))
    piece = (8 // ranks) * (8 // ranks) * FLOAT
    assert mode.get_comm_counts() == {"all_to_all": 1}
    assert mode.get_comm_bytes() == {"all_to_all": CommBytes(piece * (ranks - 1), piece * (ranks - 1))}


@spmd(meshes=[(2, 2)])
def test_two_dimensional_mesh_counts_per_mesh_dim(mesh):
    x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Replicate(), Shard(0)])
    with CommDebugMode() as mode:
        full = x.full_tensor()
    assert torch.equal(full, torch.arange(32.0).reshape(8, 4))
    assert [(record.kind, record.mesh_dim, record.group_size) for record in mode.records] == [("all_gather", 1, 2)]
    assert mode.get_comm_bytes() == {"all_gather": CommBytes(4 * 4 * FLOAT, 4 * 4 * FLOAT)}
    assert "all_gather on mesh dim 1: 1" in mode.generate_comm_debug_tracing_table(noise_level=1)


@spmd(meshes=[(2,), (4,)])
def test_local_ops_issue_nothing_and_fallback_ops_are_named(mesh):
    a = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        total = a + b
    assert mode.get_total_counts() == 0 and mode.get_fallback_counts() == {}
    assert torch.equal(total.full_tensor(), torch.arange(16.0).reshape(4, 4) + 1)

    matrix = 2 * torch.eye(4) + 0.5
    sharded_matrix = distribute_tensor(matrix, mesh, [Shard(0)])
    with CommDebugMode() as mode:
        reflectors, _ = torch.geqrf(sharded_matrix)  # no sharding rule (no meta kernel): replicate fallback
    assert mode.get_fallback_counts() == {"aten.geqrf.default": 1}
    assert mode.get_comm_counts_by_op() == {"aten.geqrf.default": {"all_gather": 1}}
    torch.testing.assert_close(reflectors.full_tensor(), torch.geqrf(matrix)[0])
    table = mode.generate_comm_debug_tracing_table(noise_level=1)
    assert "    **aten.geqrf.default\n      shape: [[4, 4]]\n      sharding: ['[S(0)]']\n" in table
    assert "      collectives: all_gather x1\n" in table
    assert "Replicate fallback (no sharding rule):\n  aten.geqrf.default: 1" in table


@spmd(meshes=[(2,)])
def test_mode_is_reusable_nests_with_observe_and_prints_c10d_names(mesh):
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    mode = CommDebugMode()
    with comm.observe() as outer:
        with mode:
            x.full_tensor()
        with mode:
            x.full_tensor()
            x.full_tensor()
    assert len(outer) == 3
    assert mode.get_comm_counts() == {"all_gather": 2}
    assert mode.generate_comm_debug_tracing_table(noise_level=0).splitlines() == [
        "Global",
        "  FORWARD PASS",
        "    *all_gather: 2 (sent 32 B, received 32 B)",
    ]
    assert mode.generate_comm_debug_tracing_table(noise_level=1).splitlines()[3:] == [
        "Totals: 2 collectives, sent 32 B, received 32 B",
        "  all_gather (c10d all_gather_into_tensor): 2, sent 32 B, received 32 B",
        "By mesh dim:",
        "  all_gather on mesh dim 0: 2",
    ]
    assert C10D_NAMES["all_gather"] == "all_gather_into_tensor"


# --- per module: a row-wise / column-wise MLP, forward and backward ------------------------------------


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(10, 16)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def _sharded(module, mesh, dim_by_name):
    """Parameters sharded on the last mesh dim (tensor parallel), replicated on the others."""
    for name, dim in dim_by_name.items():
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(dim) if dim is not None else Replicate()]
        parameter = getattr(module, name)
        module.register_parameter(name, torch.nn.Parameter(distribute_tensor(parameter.data, mesh, placements)))


def _tensor_parallel_mlp(mesh):
    """Hand-sharded like ColwiseParallel net1 / RowwiseParallel net2: net1 takes a plain input as
    Replicate, net2 gives a plain Replicate output; one all_reduce forward (net2's Partial output)
    and one backward (the Partial gradient of net1's input)."""
    torch.manual_seed(0)
    reference = MLP()
    model = MLP()
    model.load_state_dict(reference.state_dict())
    replicate = [Replicate()] * mesh.ndim
    distribute_module(model.net1, mesh, lambda name, module, mesh: _sharded(module, mesh, {"weight": 0, "bias": 0}),
                      input_fn=lambda module, inputs, mesh: tuple(DTensor.from_local(x, mesh, replicate) for x in inputs))
    distribute_module(model.net2, mesh, lambda name, module, mesh: _sharded(module, mesh, {"weight": 1, "bias": None}),
                      output_fn=lambda module, output, mesh: output.redistribute(placements=replicate).to_local())
    return reference, model


def _run_mlp(mesh, mode):
    reference, model = _tensor_parallel_mlp(mesh)
    x = torch.randn(8, 10)
    x_reference, x_sharded = x.clone().requires_grad_(), x.clone().requires_grad_()
    reference(x_reference).sum().backward()
    with mode:
        output = model(x_sharded)
        output.sum().backward()
    assert_close(output, reference(x))
    assert_close(x_sharded.grad, x_reference.grad)
    for (name, parameter), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close(parameter.grad.full_tensor(), expected.grad, msg=name)
    return model


@spmd(meshes=[(1,), (2,), (4,), (2, 2)])
def test_mlp_collectives_per_module_forward_and_backward(mesh):
    mode = CommDebugMode()
    _run_mlp(mesh, mode)
    one = {} if mesh.size(-1) == 1 else {"all_reduce": 1}
    assert mode.get_comm_module_counts() == {
        "Global": {"forward": one, "backward": one},
        "MLP": {"forward": one, "backward": one},
        "MLP.net1": {"forward": {}, "backward": one},
        "MLP.relu": {"forward": {}, "backward": {}},
        "MLP.net2": {"forward": one, "backward": {}},
    }
    assert mode.comm_module_counts == mode.get_comm_module_counts()
    if one:
        ring = 2 * (mesh.size(-1) - 1) * 8 * 10 * FLOAT // mesh.size(-1)  # the [8, 10] Partial, summed
        assert mode.get_comm_module_bytes()["MLP.net2"]["forward"] == {"all_reduce": CommBytes(ring, ring)}
        assert mode.get_comm_module_bytes()["MLP.net1"]["backward"] == {"all_reduce": CommBytes(ring, ring)}
        assert [(record.kind, record.mesh_dim) for record in mode.records] == [("all_reduce", mesh.ndim - 1)] * 2
    last = [Replicate()] * (mesh.ndim - 1)
    assert mode.get_sharding_info() == {
        "MLP.net1.weight": (*last, Shard(0)), "MLP.net1.bias": (*last, Shard(0)),
        "MLP.net2.weight": (*last, Shard(1)), "MLP.net2.bias": (*last, Replicate()),
    }
    assert {module: sorted(parameters) for module, parameters in mode.get_parameter_info().items()} == {
        "MLP.net1": ["bias", "weight"], "MLP.net2": ["bias", "weight"],
    }


@spmd(meshes=[(2,)])
def test_mlp_tracing_table_at_each_noise_level(mesh):
    mode = CommDebugMode()
    _run_mlp(mesh, mode)
    counted = "*all_reduce: 1 (sent 320 B, received 320 B)"
    assert mode.generate_comm_debug_tracing_table(noise_level=0).splitlines() == [
        "Global",
        "  FORWARD PASS",
        f"    {counted}",
        "  BACKWARD PASS",
        f"    {counted}",
        "    MLP",
        "      FORWARD PASS",
        f"        {counted}",
        "      BACKWARD PASS",
        f"        {counted}",
        "        MLP.net1",
        "          BACKWARD PASS",
        f"            {counted}",
        "        MLP.relu",
        "        MLP.net2",
        "          FORWARD PASS",
        f"            {counted}",
    ]
    one = mode.generate_comm_debug_tracing_table(noise_level=1)
    assert "        MLP.net1\n        *module type: Linear\n        *Parameter List\n         *weight: [S(0)]\n" in one
    assert ("            **aten.addmm.default\n"
            "              shape: [[10], [8, 16], [16, 10]]\n"
            "              sharding: ['[R]', '[S(1)]', '[S(0)]']\n") in one
    assert "(local)" not in one and "aten.t.default" not in one
    two = mode.generate_comm_debug_tracing_table(noise_level=2)
    assert "aten.t.default" not in two
    # net2's addmm on DTensors, then the local addmm it ran, then the all_reduce of its output hook
    net2_forward = two[two.index("        MLP.net2"):]
    assert net2_forward.index("**aten.addmm.default\n") < net2_forward.index("**aten.addmm.default (local)")
    assert net2_forward.index("**aten.addmm.default (local)") < net2_forward.index("**c10d.allreduce_.default")
    three = mode.generate_comm_debug_tracing_table()
    assert "**aten.t.default" in three
    explained = "redistribute [P(sum)] shape=(8, 10) mesh=(2,)  ->  [R], 4-byte items: 1 step(s)"
    assert three.count("**redistribute plan") == len(mode.get_redistribute_plans())
    assert three.count(explained) == 2  # net2's output (forward) and net1's input gradient (backward)
    assert [(module, phase) for module, phase, plan in mode.get_redistribute_plans() if str(plan).startswith(explained)] == [
        ("MLP.net2", "forward"), ("MLP.net1", "backward"),
    ]
    with pytest.raises(ValueError, match="noise_level must be an int from 0 to 3"):
        mode.generate_comm_debug_tracing_table(noise_level=4)


@spmd(meshes=[(2,)])
def test_json_dump_and_table_file(mesh):
    mode = CommDebugMode()
    _run_mlp(mesh, mode)
    with tempfile.TemporaryDirectory() as directory:
        json_path = os.path.join(directory, f"comm_{mesh.get_rank()}.json")
        text_path = os.path.join(directory, f"comm_{mesh.get_rank()}.txt")
        mode.generate_json_dump(json_path, noise_level=1)
        mode.log_comm_debug_tracing_table_to_file(text_path, noise_level=2)
        with open(json_path) as json_file:
            tree = json.load(json_file)
        with open(text_path) as text_file:
            assert text_file.read() == mode.generate_comm_debug_tracing_table(noise_level=2)
    assert tree["fqn"] == "Global" and tree["collectives_forward"] == [["all_reduce", 1]]
    (mlp,) = tree["children"]
    assert [child["fqn"] for child in mlp["children"]] == ["MLP.net1", "MLP.relu", "MLP.net2"]
    net1, _, net2 = mlp["children"]
    assert net1["module_type"] == "Linear" and net1["parameters"] == [["weight", "[S(0)]"], ["bias", "[S(0)]"]]
    assert net1["collectives_forward"] == [] and net1["collectives_backward"] == [["all_reduce", 1]]
    assert net2["bytes_forward"] == {"all_reduce": {"sent": 320, "received": 320}}
    assert [operation["name"] for operation in net2["operations_forward"]] == ["aten.addmm.default"]
    assert net2["plans_forward"] == []  # plans from noise level 3


@spmd(meshes=[(2,)])
def test_hooks_are_removed_on_exit(mesh):
    mode = CommDebugMode()
    model = _run_mlp(mesh, mode)
    modules, operations = mode.get_modules(), len(mode.operations)
    model(torch.randn(8, 10)).sum().backward()
    assert mode.get_modules() == modules and len(mode.operations) == operations and mode.get_total_counts() == 2


@spmd(meshes=[(2,), (4,)])
def test_sequence_parallel_mlp_gathers_forward_and_reduce_scatters_backward(mesh):
    """Rows of the input and output sharded (sequence parallel): net1 all_gathers its input forward and
    reduce_scatters its gradient backward; net2 reduce_scatters its output forward, all_gathers backward."""
    ranks, rank = mesh.size(), mesh.get_rank()
    reference, model = MLP(), MLP()
    model.load_state_dict(reference.state_dict())
    distribute_module(
        model.net1, mesh, lambda name, module, mesh: _sharded(module, mesh, {"weight": 0, "bias": 0}),
        input_fn=lambda module, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Shard(0)], shard_sizes="chunk").redistribute(placements=[Replicate()])
            for x in inputs),
    )
    distribute_module(model.net2, mesh, lambda name, module, mesh: _sharded(module, mesh, {"weight": 1, "bias": None}),
                      output_fn=lambda module, output, mesh: output.redistribute(placements=[Shard(0)]).to_local())
    x = torch.randn(8, 10)
    x_reference, x_local = x.clone().requires_grad_(), x.chunk(ranks)[rank].clone().requires_grad_()
    reference(x_reference).sum().backward()
    with CommDebugMode() as mode:
        output = model(x_local)
        output.sum().backward()
    assert_close(output, reference(x).chunk(ranks)[rank])
    assert_close(x_local.grad, x_reference.grad.chunk(ranks)[rank])
    assert_close(model.net1.weight.grad.full_tensor(), reference.net1.weight.grad)
    both = {"all_gather": 1, "reduce_scatter": 1}
    assert mode.get_comm_module_counts() == {
        "Global": {"forward": both, "backward": both},
        "MLP": {"forward": both, "backward": both},
        "MLP.net1": {"forward": {"all_gather": 1}, "backward": {"reduce_scatter": 1}},
        "MLP.relu": {"forward": {}, "backward": {}},
        "MLP.net2": {"forward": {"reduce_scatter": 1}, "backward": {"all_gather": 1}},
    }


@spmd(meshes=[(2,), (4,)])
def test_collectives_inside_a_rule_count_for_the_module_running_it(mesh):
    """Embedding with a row-sharded index: its rule checks the indices with one all_reduce(max)."""
    torch.manual_seed(0)
    model, reference = torch.nn.Sequential(torch.nn.Embedding(10, 4)), torch.nn.Sequential(torch.nn.Embedding(10, 4))
    model.load_state_dict(reference.state_dict())
    distribute_module(model, mesh)
    ids = torch.tensor([[1, 2, 3], [4, 5, 9], [0, 0, 1], [7, 8, 2]])
    sharded_ids = distribute_tensor(ids, mesh, [Shard(0)])
    with CommDebugMode() as mode:
        output = model(sharded_ids)
        output.sum().backward()
    reference(ids).sum().backward()
    assert_close(output.full_tensor(), reference(ids))
    assert_close(model[0].weight.grad.full_tensor(), reference[0].weight.grad)
    check = {"all_reduce": 1}
    # the weight's Partial gradient (rows summed per rank) is reduced to its Replicate layout when
    # the backward pass ends, outside every module and op
    assert model[0].weight.grad.placements == (Replicate(),)
    assert mode.get_comm_module_counts() == {
        "Global": {"forward": check, "backward": {"all_reduce": 1}},
        "Sequential": {"forward": check, "backward": {}},
        "Sequential.0": {"forward": check, "backward": {}},
    }
    assert mode.get_comm_counts_by_op() == {"aten.embedding.default": check, OUTSIDE_OPS: {"all_reduce": 1}}


@spmd(meshes=[(2, 2)])
def test_point_to_point_exchanges_along_a_mesh_dim_are_recorded_on_it(mesh):
    """A halo exchange along a spatial dim sharded over mesh dim "sp", a ring over the "sp" sub-mesh and
    a redistribute exchange: each batch_p2p record names the mesh dims its peers differ along."""
    named = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("dp", "sp"))
    row, column = named.get_coordinate()
    double = 8  # bytes per float64 element
    signal, weight = seeded_randn((2, 3, 8), 1), seeded_randn((4, 3, 3), 2)
    x = distribute_tensor(signal, named, [Replicate(), Shard(2)])
    kernel = distribute_tensor(weight, named, [Replicate(), Replicate()])
    with CommDebugMode() as mode:  # one column of 2 x 3 values to and from the one neighbour
        convolved = F.conv1d(x, kernel, padding=1)
    assert mode.records == [comm.CommRecord("batch_p2p", 1, 2, 2 * 3 * double, 2 * 3 * double)]
    assert mode.records[0].mesh_dim_names == ("sp",)
    assert "batch_p2p on mesh dim 1: 1" in mode.generate_comm_debug_tracing_table(noise_level=1)
    assert_close(convolved.full_tensor(), F.conv1d(signal, weight, padding=1))

    query, key, value = (seeded_randn((2, 2, 8, 4), seed) for seed in (3, 4, 5))
    expected = F.scaled_dot_product_attention(query, key, value)
    set_rotate_method("alltoall")
    try:
        with context_parallel(named["sp"], buffers=[query, key, value], buffer_seq_dims=[2, 2, 2]):
            with CommDebugMode() as mode:  # k and v of one rank to the next, once on two ranks
                output = F.scaled_dot_product_attention(query, key, value)
            gathered = context_parallel_unshard(named["sp"], [output], [2])[0]
    finally:
        set_rotate_method("allgather")
    assert mode.records == [comm.CommRecord("batch_p2p", 0, 2, 2 * 2 * 2 * 4 * 4 * double, 2 * 2 * 2 * 4 * 4 * double)]
    assert mode.records[0].mesh_dim_names == ("sp",)
    assert_close(gathered, expected)

    cases = [([Shard(0), Replicate()], [Shard(1), Replicate()], 0, ("dp",), 2 * 2),  # peers along "dp" only
             ([Shard(0), Shard(0)], [Replicate(), Shard(0)], (0, 1), ("dp", "sp"), 2 * 2 * (1 + (row != column)))]
    full = seeded_randn((8, 2), 6)
    for source, target, mesh_dims, names, elements in cases:
        source_layout = Layout.create(named.shape, source, full.shape)
        target_layout = source_layout.with_placements(target)
        exchange = plan(source_layout, target_layout, double, CostModel(exchange_latency_us=0.0, latency_us=1e6))
        assert exchange.collectives == ("batch_p2p",)
        with CommDebugMode() as mode:
            moved = execute(layout_box(full, source_layout, (row, column)).clone(), exchange, named)
        assert torch.equal(moved, layout_box(full, target_layout, (row, column)))
        assert mode.records == [comm.CommRecord("batch_p2p", mesh_dims, 2, elements * double, elements * double)]
        assert mode.records[0].mesh_dim_names == names
