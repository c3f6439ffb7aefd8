"""launch: results in rank order, failing ranks reported with tracebacks, hung ranks killed, dead
workers replaced."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from shardtensor import launch
from shardtensor.launch import LocalWorkers, RankFailure


def rank_and_seeded_value(offset):
    return dist.get_rank() + offset, torch.rand(1).item()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    return "fine"


def exit_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    return "fine"


def kill_rank_zero_by_signal():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return "fine"


def hang_on_rank_zero():
    if dist.get_rank() == 1:
        raise ValueError("rank one gave up before the collective")
    dist.all_reduce(torch.ones(1))  # waits forever for rank 1


def registered_body(value):
    return value * 2


reference = launch.register(registered_body)


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2, timeout=30, grace=1.0) as pool:
        yield pool


def test_results_in_rank_order_and_seeded(workers):
    results = workers.run(rank_and_seeded_value, 10)
    assert [value for value, _ in results] == [10, 11]
    assert results[0][1] == results[1][1] == workers.run(rank_and_seeded_value, 0)[0][1]


def test_registered_function(workers):
    assert workers.run(reference, 21) == [42, 42]


def test_failure_names_rank_and_traceback(workers):
    with pytest.raises(RankFailure) as raised:
        workers.run(fail_on_rank_one)
    assert raised.value.failures.keys() == {1} and raised.value.timed_out == []
    assert "rank 1" in str(raised.value) and "ValueError: rank one is unhappy" in str(raised.value)
    assert "fail_on_rank_one" in str(raised.value)
    assert workers.run(rank_and_seeded_value, 0)[1][0] == 1, "the pool survives a clean failure"


def test_hung_rank_is_killed_within_grace(workers):
    with pytest.raises(RankFailure) as raised:
        workers.run(hang_on_rank_zero)
    assert raised.value.timed_out == [0] and 1 in raised.value.failures
    assert "rank one gave up" in str(raised.value) and "did not answer" in str(raised.value)
    assert [value for value, _ in workers.run(rank_and_seeded_value, 0)] == [0, 1], "the pool restarts"


@pytest.mark.parametrize("body, dead_rank, exitcode", [(exit_on_rank_one, 1, 3), (kill_rank_zero_by_signal, 0, -signal.SIGKILL)])
def test_a_dead_worker_is_replaced_before_the_next_task(workers, body, dead_rank, exitcode):
    with pytest.raises(RankFailure) as raised:
        workers.run(body)
    assert raised.value.failures == {dead_rank: f"worker process exited with code {exitcode}"}
    assert raised.value.timed_out == []
    for _ in range(2):
        assert [value for value, _ in workers.run(rank_and_seeded_value, 0)] == [0, 1], "the pool restarts"


def test_unpicklable_task_fails_in_the_parent(workers):
    with pytest.raises(Exception, match="pickle|Can't"):
        workers.run(lambda: 1)


def test_spawn():
    assert spawn_world() == [(0, 1)]


def spawn_world():
    return launch.spawn(world_of_this_rank, 1)


def world_of_this_rank():
    return dist.get_rank(), dist.get_world_size()
