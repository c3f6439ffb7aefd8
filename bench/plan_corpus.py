"""Every plan of a corpus of redistribute transitions, printed and hashed: a planner change that must keep
its plans (a speed-up) shows one unchanged sha256; where it does not, `--compare` lists the plans that
differ and whether any costs more.

    PYTHONPATH=src .venv/bin/python bench/plan_corpus.py OUT.txt              # writes the plans, prints count + sha256
    .venv/bin/python bench/plan_corpus.py --compare BEFORE.txt AFTER.txt      # differing plans, costs side by side

The corpus: meshes 2x2, 4, 2x3, 1x2, 2x1x2, 2x2x2; 3-7 shapes each (uneven, empty and size-1 dims included);
every {R, P, S(d)} source (nested shards also in their reversed shard order) to every {R, S(d)} target (and
{R, P, S(d)} targets on meshes of up to 2 dims); four cost models; items of 1 and 4 bytes. A plan is printed
with its steps, bytes, costs, lower bound and every step's layout after it.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import sys

MESHES = {
    (2, 2): [(512, 512), (511, 513), (6, 5), (3,), (4, 1, 5), (0, 3), (64, 33)],
    (4,): [(512, 512), (511, 513), (6, 5), (3,), (4, 1, 5)],
    (2, 3): [(512, 512), (511, 513), (6, 5), (3,), (4, 1, 5)],
    (1, 2): [(512, 512), (511, 513), (6, 5)],
    (2, 1, 2): [(512, 512), (7, 5), (3,)],
    (2, 2, 2): [(16, 9), (512, 512), (1000, 1001)],
}


def _cost_models(planner):
    return [
        planner.DEFAULT_COST_MODEL, planner.PER_MESH_DIM_COST_MODEL,
        planner.CostModel(latency_us=1.0, exchange_latency_us=1.5),
        planner.CostModel(latency_by_kind=(("reduce_scatter", 35.0), ("all_gather", 15.0))),
    ]


def _sources(mesh, shape, Layout, choices):
    """Every layout of `shape` with placements from `choices`, and nested shards in reversed shard order too."""
    for placements in itertools.product(choices, repeat=len(mesh)):
        try:
            layout = Layout.create(mesh, placements, shape)
        except ValueError:
            continue
        yield layout
        if any(len(order) > 1 for order in layout.shard_order):
            yield Layout.create(mesh, placements, shape, shard_order=[tuple(reversed(order)) for order in layout.shard_order])


def plans() -> list[str]:
    from shardtensor.layout import Layout
    from shardtensor.placement import Partial, Replicate, Shard
    from shardtensor.redistribute import planner

    out = []
    models = _cost_models(planner)
    for mesh, shapes in MESHES.items():
        large = len(mesh) == 3
        for shape in shapes:
            shards = [Shard(dim) for dim in range(len(shape))]
            for source in _sources(mesh, shape, Layout, [Replicate(), Partial(), *shards]):
                target_choices = [Replicate(), *shards] + ([] if large else [Partial()])
                for placements in itertools.product(target_choices, repeat=len(mesh)):
                    try:
                        target = source.with_placements(placements)
                    except ValueError:
                        continue
                    for model, itemsize in itertools.product(models[:2] if large else models, (1, 4)):
                        try:
                            plan = planner.plan(source, target, itemsize, model)
                            text = str(plan) + "".join(f"\n    after {step.after!s}" for step in plan.steps)
                        except ValueError as error:
                            text = f"{source} -> {target}: ERR {error}"
                        out.append(f"[model {models.index(model)}] {text}")
    return out


def _total(text: str) -> float | None:
    found = re.search(r"total \d+ bytes/rank, ([0-9.]+) us", text)
    return float(found.group(1)) if found else None


def compare(before_path: str, after_path: str) -> None:
    before = open(before_path).read().split("\n\n")
    after = open(after_path).read().split("\n\n")
    assert len(before) == len(after), (len(before), len(after))
    differing = [(old, new) for old, new in zip(before, after) if old != new]
    dearer = [(old, new) for old, new in differing if (_total(new) or 0) > (_total(old) or 0) + 1e-9]
    print(f"{len(before)} plans, {len(differing)} differ, {len(dearer)} cost more")
    for old, new in differing[:20]:
        print(f"--- before ({_total(old)} us)\n{old}\n+++ after ({_total(new)} us)\n{new}\n")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        texts = plans()
        joined = "\n\n".join(texts)
        open(sys.argv[1], "w").write(joined)
        print(len(texts), hashlib.sha256(joined.encode()).hexdigest())
