"""Logging (logger `shardtensor`): every new propagation decision and redistribute plan at DEBUG, with
its cost; nothing for cached ones; no work at all when off; `SHARDTENSOR_LOG` switches it on."""

import contextlib
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch
from spmd import spmd

from shardtensor import Replicate, Shard, distribute_tensor, log, propagation
from shardtensor.redistribute import explain
from shardtensor.redistribute.planner import _cached_plan


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def _logged(level):
    """The records the `shardtensor` logger emits in the block at `level`, from fresh caches."""
    handler, logger = _Collect(), logging.getLogger("shardtensor")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    propagation.clear_cache()
    _cached_plan.cache_clear()
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@spmd(meshes=[(2,)])
def test_new_decisions_and_plans_are_logged_once_with_their_cost(mesh):
    a = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    with _logged(logging.DEBUG) as records:
        total = a + b
        again = a + b  # cached decision and plan: nothing more is logged
    torch.testing.assert_close(again.full_tensor(), torch.arange(16.0).reshape(4, 4) + 1)
    assert total.placements == (Shard(0),)
    decisions = [record for record in records if record.name == "shardtensor.propagation"]
    plans = [record for record in records if record.name == "shardtensor.redistribute"]
    assert len(decisions) == 1 and len(plans) == 1
    plan_text = explain(b.sharding, b.sharding.with_placements([Shard(0)]), 4)
    assert plans[0].levelno == logging.DEBUG and plans[0].getMessage() == "planned " + plan_text
    cost = plan_text.splitlines()[-1].split(", ")[1].split(";")[0]  # "total N bytes/rank, C us; ..." -> "C us"
    assert decisions[0].getMessage() == (
        f"aten.add.Tensor on mesh (2,): inputs [S(0)]; [S(1)] -> [S(0)]; outputs [S(0)] (4, 4); "
        f"rows per mesh dim [S(0) <- S(0), S(0)]; moving inputs costs {cost}"
    )


@spmd(meshes=[(2,)])
def test_off_costs_nothing(mesh):
    a = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])

    def must_not_run(*args, **kwargs):
        raise AssertionError("the decision was formatted although DEBUG is off")

    original = propagation.log_decision
    propagation.log_decision = must_not_run
    try:
        with _logged(logging.INFO) as records:
            result = (a * 2).redistribute(placements=[Replicate()])
    finally:
        propagation.log_decision = original
    assert records == []
    torch.testing.assert_close(result.to_local(), torch.arange(8.0).reshape(4, 2) * 2)


def test_environment_variable_sets_level_and_handler():
    logger = logging.getLogger("shardtensor")
    old_level, old_handlers = logger.level, list(logger.handlers)
    try:
        logger.handlers = []
        log.configure_from_environment({"SHARDTENSOR_LOG": "Debug"})
        assert logger.level == logging.DEBUG and len(logger.handlers) == 1
        log.configure_from_environment({})  # unset: nothing changes
        assert logger.level == logging.DEBUG and len(logger.handlers) == 1
        with pytest.raises(ValueError, match=r"SHARDTENSOR_LOG='loud' is not a log level; use one of \['debug'"):
            log.configure_from_environment({"SHARDTENSOR_LOG": "loud"})
    finally:
        logger.setLevel(old_level)
        logger.handlers = old_handlers


_SCRIPT = """
import torch
from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh
mesh = init_device_mesh("cpu", (1,))
distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).redistribute(placements=[Replicate()])
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_environment_variable_switches_logging_on_without_code_changes():
    environment = dict(os.environ, SHARDTENSOR_LOG="debug", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                       RANK="0", WORLD_SIZE="1", PYTHONPATH=os.pathsep.join(sys.path))
    finished = subprocess.run([sys.executable, "-c", _SCRIPT], env=environment, capture_output=True, text=True,
                              timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "shardtensor.redistribute DEBUG: planned redistribute [S(0)] shape=(4, 4) mesh=(1,)  ->  [R]" in finished.stderr
