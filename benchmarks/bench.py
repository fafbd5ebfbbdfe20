"""opgraph's speed, as ratios measured in one run: `python benchmarks/bench.py`.

(a) `opgraph profile`, whole process, over `python -c "import sympy, networkx"` (target <= 1.5)
(b) building, compiling and evaluating Llama 3.1 405B over Llama 3 8B, in process (<= 1.2): the
    layer stack is held once, so depth costs nothing (each in a fresh interpreter, timed inside)
(c) per configuration, a 100,000-point sweep after compile beside single `evaluate` calls
    (target <= 0.5 us)
(d) `opgraph sweep --tokens 8192:819200000:+8192 --out f.csv` (100,000 rows), whole process,
    over `opgraph profile` (target <= 2)

Every figure is a median of a few runs, each ratio the median of side-by-side pairs;
subprocesses run this checkout's code (PYTHONPATH).
About half a minute on two slow cores.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = 5


def median_seconds(fn, runs: int = RUNS) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def processes(commands: dict[str, list[str]], cwd: str) -> dict[str, list[float]]:
    """Wall times of fresh interpreters running each command, taken in turn (a, b, c, a, b,
    c, ...) so that load from elsewhere on the machine falls on all of them alike."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPGRAPH_CACHE_DIR": "off"}
    times = {name: [] for name in commands}
    for run in range(RUNS + 1):
        for name, argv in commands.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, *argv], cwd=cwd, env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if run:  # the first round warms the file cache
                times[name].append(time.perf_counter() - start)
    return times


def ratio(times: dict, a: str, b: str) -> float:
    """The median of the runs' ratios a / b, each pair taken side by side."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def line(label: str, value: str, note: str = "") -> None:
    print(f"  {label:<56} {value:>10}  {note}".rstrip())


def verdict(ratio: float, target: float) -> str:
    return f"(target <= {target:g}: {'met' if ratio <= target else 'MISSED'})"


def main() -> int:
    import numpy
    import sympy
    from opgraph.models import preset

    from opgraph import compile_step, evaluate, hardware
    from opgraph.analysis.sweep import compile_sweep

    print(f"opgraph benchmarks: python {sys.version.split()[0]}, sympy {sympy.__version__}, "
          f"numpy {numpy.__version__}, {os.cpu_count()} cores; medians of {RUNS} runs")
    h100 = hardware.get("h100-sxm")

    # (c) first, in this process, before anything else has run for a while.
    step = compile_step(preset("llama3-8b"))
    n = 100_000
    batch = numpy.arange(1, n + 1)
    seq = numpy.full(n, 8192)
    compiled = compile_sweep(step)
    compiled.run({"B": batch, "S": seq}, h100.peak_flops, h100.bandwidth)  # warm
    per_point = median_seconds(
        lambda: compiled.run({"B": batch, "S": seq}, h100.peak_flops, h100.bandwidth),
        2 * RUNS + 1) / n
    calls = 200
    per_eval = median_seconds(
        lambda: [evaluate(step, h100, {"B": k}) for k in range(1, calls + 1)], 3) / calls

    # (b) in fresh interpreters, so neither model finds the other's work in sympy's caches;
    # each times only its own build + compile_step + evaluate.
    code = ("import time; from opgraph.models import preset; from opgraph import compile_step, evaluate, "
            "hardware; part = hardware.get('h100-sxm'); t = time.perf_counter(); "
            "step = compile_step(preset({!r})); evaluate(step, part); "
            "print(time.perf_counter() - t, len(step.ops()))")
    inner = {"llama3-8b": [], "llama3.1-405b": []}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPGRAPH_CACHE_DIR": "off"}
    ops = {}
    for _ in range(RUNS):  # interleaved, so drift hits both
        for name, samples in inner.items():
            out = subprocess.run([sys.executable, "-c", code.format(name)], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            samples.append(float(out[0]))
            ops[name] = int(out[1])
    t8, t405 = (statistics.median(inner[k]) for k in ("llama3-8b", "llama3.1-405b"))
    deep = statistics.median(x / y for x, y in zip(inner["llama3.1-405b"], inner["llama3-8b"]))

    # (a) and (d): whole processes, taken in turn.
    with tempfile.TemporaryDirectory() as tmp:
        times = processes({
            "profile": ["-m", "opgraph", "profile"],
            "imports": ["-c", "import sympy, networkx"],
            "sweep": ["-m", "opgraph", "sweep", "--tokens", "8192:819200000:+8192",
                      "--out", "f.csv"],
        }, cwd=tmp)
        with open(Path(tmp) / "f.csv") as f:
            rows = sum(1 for _ in f) - 1
    profile, imports, sweep_cli = (statistics.median(times[k])
                                   for k in ("profile", "imports", "sweep"))
    whole, sweeping = ratio(times, "profile", "imports"), ratio(times, "sweep", "profile")

    print("(a) whole process")
    line("opgraph profile", f"{profile:.3f} s")
    line('python -c "import sympy, networkx"', f"{imports:.3f} s")
    line("ratio", f"{whole:.2f}", verdict(whole, 1.5))
    print("(b) build + compile_step + evaluate, in process (a fresh one each)")
    line("llama3.1-405b (126 layers)", f"{t405 * 1e3:.1f} ms",
         f"({ops['llama3.1-405b']} ops in the step's graph)")
    line("llama3-8b (32 layers)", f"{t8 * 1e3:.1f} ms", f"({ops['llama3-8b']} ops)")
    line("ratio", f"{deep:.2f}", verdict(deep, 1.2))
    print("(c) per configuration")
    line(f"sweep of {n:,} points after compile", f"{per_point * 1e6:.3f} us",
         verdict(per_point * 1e6, 0.5))
    line(f"single evaluate, {calls} calls", f"{per_eval * 1e6:.0f} us",
         f"({per_eval / per_point:,.0f} x the sweep's)")
    print("(d) whole process")
    line("opgraph sweep --tokens 8192:819200000:+8192 --out f.csv", f"{sweep_cli:.3f} s",
         f"({rows:,} rows)")
    line("opgraph profile", f"{profile:.3f} s")
    line("ratio", f"{sweeping:.2f}", verdict(sweeping, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
