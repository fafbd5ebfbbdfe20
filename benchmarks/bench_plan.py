"""`opgraph plan`'s speed: `python benchmarks/bench_plan.py [--quick]`.

(a) layouts per second after compile: a search run twice in one process, the second with the
    first's structures already compiled (and its arrays dropped); its layouts searched over its
    time (enumerating them, every layout's compute bound, the memory and bounds of the
    structures it evaluates, and the exact schedules of the branch and bound) — issue #23's
    target is 100,000 per second on one core; then once more with the first search's garbage
    collected beforehand (where Python's collector runs moves (a))
(b) the arrays alone, every structure compiled beforehand: the same layouts' compute bounds,
    and their memory and bounds as the compiled structures give them, no exact schedule, per
    second — issue #23's target for the bound arrays is 1,000,000 per second
(c) the whole process of a full search of Llama 3.1 405B on 16,384 H100s at 16 M tokens per
    step, with the layouts it searched — the target is 10 s

--quick runs (a) and (b) on Llama 3 8B on 64 GPUs and skips (c). Figures of one run on this
machine; subprocesses run this checkout's code (PYTHONPATH).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def after_compile(model: str, gpus: int, batch: int) -> None:
    from opgraph import hardware
    from opgraph.cost.costmodel import cost_model
    from opgraph.models import preset
    from opgraph.parallel.search import Searcher, Space, rows, structure
    from opgraph.parallel.search.bounds import _compute_bound

    forward, part = preset(model), hardware.get("h100-sxm")
    searcher = Searcher(forward, part, cost=cost_model("calibrated"))
    space = Space(gpus=gpus, batch=batch)
    first = searcher.search(space)
    searcher.forget()  # the arrays are evaluated again; the compiled structures are kept
    start = time.perf_counter()
    again = searcher.search(space)
    warm = time.perf_counter() - start
    print(f"{model} on {gpus:,} GPUs: {first.searched:,} layouts over {first.structures} "
          f"structures, {first.evaluated} of them compiled and evaluated, in "
          f"{first.compile_s:.1f} s")
    print(f"(a) after compile: {again.searched:,} layouts in {warm:.2f} s = "
          f"{again.searched / warm:,.0f} layouts/s ({again.scheduled:,} scheduled exactly; "
          "target 100,000)")
    # the same once more, the garbage of the first search's compile collected beforehand: how
    # much of (a) is the collector's, wherever it happened to run
    searcher.forget()
    gc.collect()
    start = time.perf_counter()
    searcher.search(space)
    collected = time.perf_counter() - start
    print(f"    the same, garbage collected first: {collected:.2f} s = "
          f"{again.searched / collected:,.0f} layouts/s")
    found = rows(forward, part, space, searcher.seq, searcher.cluster)
    groups: dict = {}
    computes: dict = {}
    for r in found:
        groups.setdefault(structure(r), []).append(r)
        computes.setdefault(searcher.compute_key(r), []).append(r)
    t0 = searcher.compile_s
    for group in groups.values():
        searcher.structure(group[0])  # compiled, not timed
    compiled = searcher.compile_s - t0
    start = time.perf_counter()
    for group in computes.values():
        _compute_bound(searcher.compute(group[0]), group, searcher.layers, part,
                       searcher.cost, searcher._line)
    bounds = time.perf_counter() - start
    start = time.perf_counter()
    for group in groups.values():
        searcher.evaluate(group)
    arrays = time.perf_counter() - start
    print(f"(b) the arrays alone: {len(found):,} layouts' compute bounds in {bounds:.2f} s = "
          f"{len(found) / bounds:,.0f} layouts/s (target 1,000,000); their memory and bounds "
          f"from all {len(groups)} structures (the rest compiled in {compiled:.1f} s first) in "
          f"{arrays:.2f} s = {len(found) / arrays:,.0f} layouts/s")


def whole_405b() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPGRAPH_CACHE_DIR": "off"}
    argv = [sys.executable, "-m", "opgraph", "plan", "--model", "llama3.1-405b", "--gpus",
            "16384", "--tokens", str(16 * 2**20), "--json", "--top", "1"]
    start = time.perf_counter()
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    elapsed = time.perf_counter() - start
    data = json.loads(out)
    print(f"(c) llama3.1-405b on 16,384 H100s, whole process: {elapsed:.1f} s for "
          f"{data['searched']:,} layouts ({data['evaluated']} of {data['structures']} "
          f"structures compiled, in {data['compile_s']:.1f} s; target 10 s)")


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    after_compile("llama3-8b", 64, 256)
    if not quick:
        whole_405b()
