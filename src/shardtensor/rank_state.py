"""The library's state that belongs to one rank, so that `launch.simulate` can run many ranks in one process.

A real run has one rank per process and never reads this module. A module whose globals belong to the
rank (its process groups, its random counter, the comm observers it has open) registers how to save,
restore and start that state with `per_rank`; the simulator, which runs one rank at a time, saves the
leaving rank's state and installs the arriving rank's at each switch. The hot path reads its globals
as before: switching costs the simulator a few assignments, and a real run nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["per_rank", "per_rank_contents", "fresh_state", "saved_state", "install_state"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Holder:
    save: Callable[[], object]  # the current rank's state, as a value `restore` takes back
    restore: Callable[[object], None]
    fresh: Callable[[], object]  # the state of a rank that has done nothing yet


_holders: dict[str, _Holder] = {}


def per_rank(name: str, save: Callable[[], object], restore: Callable[[object], None],
             fresh: Callable[[], object]) -> None:
    """Register the per-rank state of module `name` (at its import)."""
    _holders[name] = _Holder(save, restore, fresh)


def per_rank_contents(name: str, container: list | dict) -> None:
    """Register a module-level list or dict that other modules import by name: switching ranks swaps its
    contents, not the object (a fresh rank's is empty)."""

    def restore(contents) -> None:
        container.clear()
        if isinstance(container, list):
            container.extend(contents)
        else:
            container.update(contents)

    per_rank(name, lambda: container.copy(), restore, lambda: type(container)())


def fresh_state() -> dict[str, object]:
    """The state of a new rank: every registered module's fresh state."""
    return {name: holder.fresh() for name, holder in _holders.items()}


def saved_state() -> dict[str, object]:
    """The state of the rank running now."""
    return {name: holder.save() for name, holder in _holders.items()}


def install_state(state: dict[str, object]) -> None:
    """Make `state` the running rank's (a module imported since `state` was taken starts fresh)."""
    for name, holder in _holders.items():
        holder.restore(state[name] if name in state else holder.fresh())
