"""Forecast benchmark: accuracy against real gloo runs, cost at scale, and first-call redistribute planning.

    .venv/bin/python bench/bench_forecast.py accuracy [CALIBRATION.json ...]   # item-2 table: real 2/4-rank runs vs the forecast
    .venv/bin/python bench/bench_forecast.py scale      # the demo's forecast at 8x8x16 and 16x16x64
    .venv/bin/python bench/bench_forecast.py planning   # first-call plan, ours vs torch, bench_redistribute's 2x2 rows

Accuracy rows run the step on real local ranks (tests/test_forecast.py's helpers: the step twice, the
second counted) and as one fake rank here; time is the calibrated-now alpha-beta model against the
step's collectives replayed on gloo, then the stored "gloo-local" calibration's model against the same replay
(the stored `forecast/calibrated_gloo.json`, or each calibration file given), and the whole measured step
(compute included) for reference.
"""

from __future__ import annotations

import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

CASES = [("demo", (2, 2)), ("demo", (4, 1)), ("redistribute", (2,)), ("redistribute", (4,)), ("redistribute", (2, 2))]


def accuracy(calibrations: list[str]) -> None:
    import spmd
    import test_forecast as helpers
    from shardtensor import launch
    from shardtensor.comm import CommRecord
    from shardtensor.forecast import HardwareProfile, calibrated_profile
    from shardtensor.forecast.profiles import CALIBRATION_FILE, cost_model

    paths = [Path(path) for path in calibrations] or [CALIBRATION_FILE]
    stored = [calibrated_profile(path) for path in paths]
    forecasts = {case: helpers._forecast_records(case[1], case[0], 0) for case in CASES}
    print("| step | mesh | collectives (forecast = real) | bytes received | peak forecast / measured | "
          "modeled comm / replayed comm | " + " | ".join(f"{path.name} modeled / replayed" for path in paths)
          + " | measured step |")
    print("|---|---|---|---|---|---|" + "---|" * len(stored) + "---|")
    for name, shape in CASES:
        with launch.LocalWorkers(math.prod(shape), timeout=600) as pool:
            records, kinds, peak, _, step_seconds = pool.run(spmd._run_body, helpers._REAL_RUN, shape,
                                                             {"build_name": name, "shape": shape})[0]
            (latencies, bytes_per_us), replayed = pool.run(spmd._run_body, helpers._REPLAY, shape,
                                                           {"shape": shape, "records": records, "rounds": 4})[0]
        forecast_records, forecast_peak, _ = forecasts[name, shape]
        link = cost_model(latencies, bytes_per_us)
        here = HardwareProfile("gloo-now", 4, link, link, "measured now")
        as_records = [CommRecord(k, None, g, s, r, d or None) for k, d, g, s, r in forecast_records]
        modeled = _modeled_seconds(as_records, shape, here)
        by_stored = [_modeled_seconds(as_records, shape, profile) for profile in stored]
        equal = "yes" if forecast_records == records else "NO"
        received = sum(record[4] for record in records)
        print(f"| {name} | {'x'.join(map(str, shape))} | {len(records)} ({equal}) | {received:,} | "
              f"{forecast_peak:,} / {peak:,} ({forecast_peak / peak:.3f}) | {modeled * 1e3:.2f} / {replayed * 1e3:.2f} ms "
              f"({modeled / replayed:.2f}x) | "
              + "".join(f"{seconds * 1e3:.2f} ms ({seconds / replayed:.2f}x) | " for seconds in by_stored)
              + f"{step_seconds * 1e3:.1f} ms |")


def _modeled_seconds(records, shape, profile) -> float:
    """The records' communication time under `profile`, on rank 0."""
    from test_forecast import _names

    from shardtensor.forecast import price

    return sum(c.time_us for c in price(records, shape, _names(shape), (0,) * len(shape), profile)) * 1e-6


def _scale_one(shape: str) -> None:
    from shardtensor.demo.forecast import fit_options, forecast_demo
    from shardtensor.demo.train import Options

    mesh = tuple(int(size) for size in shape.split("x"))
    began_cpu, began = time.process_time(), time.perf_counter()
    result = forecast_demo(fit_options(Options(), mesh), mesh)
    print(f"| {shape} | {math.prod(mesh):,} | {time.perf_counter() - began:.1f} | {time.process_time() - began_cpu:.1f} | "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} | {len(result.collectives)} | "
          f"{result.communication_us / 1000:.2f} | {result.peak_bytes / 1e6:.2f} |")


def scale() -> None:
    print("| mesh | ranks | wall s | CPU s | max RSS MB | collectives | modeled comm ms (dgx-h100) | peak MB |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in ("8x8x16", "16x16x64"):
        subprocess.run([sys.executable, "-W", "ignore", __file__, "_scale_one", shape], check=True)


def planning() -> None:
    """First-call planning on bench_redistribute's 2x2 rows, ours and torch's, in one fake 4-rank world."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    import torch.distributed.tensor as their
    from torch.distributed.device_mesh import init_device_mesh as their_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached, clear_redistribute_planner_cache

    import bench_redistribute as rows
    import shardtensor
    from shardtensor.layout import Layout
    from shardtensor.redistribute import planner

    mesh = their_mesh("cpu", (2, 2))
    print("| 2x2 transition | shape | ours first call (us) | torch first call (us) | ours / torch |")
    print("|---|---|---|---|---|")
    for mesh_shape, source_names, target_names in rows.TRANSITIONS:
        if mesh_shape != (2, 2):
            continue
        for shape in ((512, 512), (511, 513)):
            source = Layout.create((2, 2), rows._placements(source_names, shardtensor), shape)
            target = source.with_placements(rows._placements(target_names, shardtensor))
            meta = TensorMeta(torch.Size(shape), (shape[1], 1), torch.float32)
            their_source = DTensorSpec(mesh, tuple(rows._placements(source_names, their)), tensor_meta=meta)
            their_target = DTensorSpec(mesh, tuple(rows._placements(target_names, their)), tensor_meta=meta)

            def ours():
                planner.plan(source, target, 4)

            def theirs():
                _gen_transform_infos_non_cached(their_source, their_target)

            ours_us, theirs_us = _first_call_us(ours, setup=rows._clear_planner_caches), _first_call_us(theirs, setup=clear_redistribute_planner_cache)
            print(f"| {'+'.join(source_names)} -> {'+'.join(target_names)} | {shape} | {ours_us:.0f} | {theirs_us:.0f} | "
                  f"{ours_us / theirs_us:.2f} |")
    dist.destroy_process_group()


def _first_call_us(function, repeats: int = 21, setup=None) -> float:
    """Median time of `function`, `setup` (emptying caches) run before each call and not timed."""
    from timing import call_times  # bench/, on the path when this file runs as a script

    return statistics.median(call_times(function, repeats, before=setup)) * 1e6


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    command = sys.argv[1] if len(sys.argv) > 1 else "accuracy"
    if command == "_scale_one":
        _scale_one(sys.argv[2])
    elif command == "accuracy":
        accuracy(sys.argv[2:])
    else:
        {"scale": scale, "planning": planning}[command]()
