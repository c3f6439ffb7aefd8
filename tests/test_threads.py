"""Thread policy: modes and the `with mesh:` stack are per thread; the RNG counter is process-wide
and hands every random call a distinct value, whatever the threads."""

import threading

import torch
from spmd import spmd

import shardtensor
from shardtensor import DeviceMesh, modes, random
from shardtensor.mesh import current_mesh


def _state():
    return modes.is_strict(), modes.is_explicit(), modes.indices_trusted()


@spmd(meshes=[(1,)])
def test_two_threads_with_different_modes_and_meshes_at_once(mesh):
    other_mesh = DeviceMesh("cpu", torch.arange(1))
    both_inside = threading.Barrier(2, timeout=30)
    both_checked = threading.Barrier(2, timeout=30)
    seen = {}

    def strict_thread():
        with shardtensor.strict_mode(), mesh:
            both_inside.wait()
            seen["strict"] = (_state(), current_mesh() is mesh)
            both_checked.wait()
        seen["strict after"] = _state()

    def explicit_thread():
        with shardtensor.explicit_communication(), shardtensor.trusted_indices(), other_mesh:
            both_inside.wait()
            seen["explicit"] = (_state(), current_mesh() is other_mesh)
            both_checked.wait()
        seen["explicit after"] = _state()

    threads = [threading.Thread(target=strict_thread), threading.Thread(target=explicit_thread)]
    with shardtensor.explicit_communication():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        main_state = _state()
    assert seen == {
        "strict": ((True, False, False), True),
        "explicit": ((False, True, True), True),
        "strict after": (False, False, False),
        "explicit after": (False, False, False),
    }
    assert main_state == (False, True, False), "the main thread's block is its own"


@spmd(meshes=[(1,)])
def test_random_counter_is_distinct_across_threads(mesh):
    shardtensor.manual_seed(5)
    calls_per_thread, thread_count = 200, 4
    taken = [[] for _ in range(thread_count)]

    def draw(bucket):
        for _ in range(calls_per_thread):
            bucket.append(random.next_random_call(mesh))

    threads = [threading.Thread(target=draw, args=(bucket,)) for bucket in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    every_call = sorted(call for bucket in taken for call in bucket)
    assert every_call == [(5, counter) for counter in range(calls_per_thread * thread_count)]
    assert random.next_random_call(mesh) == (5, calls_per_thread * thread_count)
