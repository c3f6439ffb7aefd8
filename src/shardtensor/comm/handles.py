"""What an asynchronous collective returns, and how a collective finishes now or later."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["CommHandle"]


class CommHandle:
    """What `async_op=True` returns: `wait()` waits for the c10d work and returns the result."""

    __slots__ = ("_works", "_finish", "_result", "_done")

    def __init__(self, works: list, finish: Callable[[], Any]):
        self._works = works
        self._finish = finish
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._done = True
            self._works = self._finish = None
        return self._result


def _complete(work, finish: Callable[[], Any], async_op: bool):
    """Return `finish()` now, or a handle that runs it after the c10d `work` when async."""
    if not async_op:
        return finish()
    works = work if isinstance(work, list) else [] if work is None else [work]
    return CommHandle(works, finish)


def _identity(result, async_op: bool):
    return CommHandle([], lambda: result) if async_op else result

