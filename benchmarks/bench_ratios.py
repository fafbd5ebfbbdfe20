"""Issue 23's speed targets as one run measures them: `python benchmarks/bench_ratios.py [--quick]`.

Each whole-process `opgraph plan` the issue names, timed beside one whole-process `opgraph
profile` (the plate: Llama 3 8B on one H100, best of 3) in the same run, and printed as a ratio
to it with the issue's target; then `opgraph --help`'s wall time (best of 5; target 0.3 s).
Ratios to a profile measured in the same run cancel most of the machine's speed and load; both
the wall-clock ratio and the CPU-time ratio (the child's user + system seconds) are given, the
latter steadier on a shared machine. The commands are the searches the docs and earlier issues
recorded for each case (docs/planning.md; the DeepSeek-V2-Lite `--rank` search is issue #13's).

Each plan runs twice with a fresh cache folder (`opgraph.parallel.search.cache`): "cold", with
nothing to read and writing the structures it compiled, what a first run costs; then "warm",
reading them back, what the next run of the same model, part and cost model costs. --quick
leaves out the two longest searches (Mixtral and DeepSeek-V2-Lite). Subprocesses run this
checkout's code (PYTHONPATH), each once: a plan is timed from one run.
"""

from __future__ import annotations

import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# no cache unless a run names one (`opgraph.parallel.search.cache`)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OPGRAPH_CACHE_DIR": "off"}

# (what the issue calls it, the arguments after `opgraph`, the target as x one profile)
PLANS = [
    ("8B on 64 GPUs", "plan --model llama3-8b --gpus 64 --tokens 2097152", 3),
    ("70B on 256", "plan --model llama3-70b --gpus 256 --tokens 4194304 --top 5", 4),
    ("Mixtral 8x7B on 64", "plan --model mixtral-8x7b --gpus 64 --tokens 2097152 --cost roofline "
     "--top 5", 8),
    ("DeepSeek-V2-Lite --rank on 8", "plan --model deepseek-v2-lite --gpus 8 --global-batch 16 "
     "--seq-len 4096 --zero 3 --rank --top 1", 10),
    ("405B on 16,384", "plan --model llama3.1-405b --gpus 16384 --tokens 16777216", 5),
]
LONG = ("Mixtral 8x7B on 64", "DeepSeek-V2-Lite --rank on 8")
HELP_TARGET_S = 0.3


def timed(args: str, cache: str = "off") -> tuple[float, float, str]:
    """Wall and CPU seconds of one `python -m opgraph ARGS`, and its output; `cache`, the
    folder its plan keeps compiled structures in (`OPGRAPH_CACHE_DIR`)."""
    argv = [sys.executable, "-m", "opgraph", *shlex.split(args)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env={**ENV, "OPGRAPH_CACHE_DIR": cache}, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"`opgraph {args}` failed ({done.returncode}): {done.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def best(args: str, runs: int) -> tuple[float, float]:
    """The fastest of `runs` runs by wall time, with its CPU seconds."""
    return min(timed(args)[:2] for _ in range(runs))


def summary(out: str) -> str:
    """The search's own summary lines: "searched N layouts over M structures ...", and with
    --rank "the best layout above ranks #K of ..."."""
    return "\n    ".join(line.strip() for line in out.splitlines()
                         if line.startswith(("searched", "the best layout above ranks")))


def main(quick: bool) -> None:
    profile_wall, profile_cpu = best("profile", 3)
    print(f"one profile: `opgraph profile` (the plate), best of 3: {profile_wall:.2f} s wall, "
          f"{profile_cpu:.2f} s CPU\n")
    print(f"{'case':<36} {'wall (s)':>8} {'CPU (s)':>8} {'x wall':>7} {'x CPU':>7} "
          f"{'target':>7}  met (CPU)")
    notes = []
    for name, args, target in PLANS:
        if quick and name in LONG:
            continue
        with tempfile.TemporaryDirectory() as folder:
            for when in ("cold", "warm"):  # the first run writes the cache the second reads
                wall, cpu, out = timed(args, folder)
                ratio_wall, ratio_cpu = wall / profile_wall, cpu / profile_cpu
                label = f"{name}, {when}"
                print(f"{label:<36} {wall:>8.1f} {cpu:>8.1f} {ratio_wall:>6.1f}x "
                      f"{ratio_cpu:>6.1f}x {target:>6}x  {'yes' if ratio_cpu <= target else 'no'}",
                      flush=True)
                notes.append(f"  {name}, {when}: opgraph {args}\n    {summary(out)}")
    help_wall, help_cpu = best("--help", 5)
    print(f"{'--help (best of 5)':<36} {help_wall:>8.2f} {help_cpu:>8.2f} {'':>7} {'':>7} "
          f"{HELP_TARGET_S:>6}s  {'yes' if help_wall <= HELP_TARGET_S else 'no'} (wall)")
    print("\ncommands run:\n" + "\n".join(notes))


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
