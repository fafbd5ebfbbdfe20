"""Hopper's attention rates and row overheads from the attention kernels measured on one H200:
`python benchmarks/device/fit_attention.py [results.json]`.

`measure_gpu.py` timed torch's scaled_dot_product_attention (causal; FlashAttention-2, the
"flash" backend, and cuDNN's) at head dims 64, 128 and 256 over 1,024 to 32,768 tokens, at a
fixed number of tokens per call (benchmarks/device/h200/results.json, run1.attention). Each
query row runs its own loop over the keys it sees (S/2 of them on average, causal) and spends
the time of k more keys outside it (loading its queries, rescaling and writing its output), so

    1 / rate(S) = (1 / rate_inf) x (1 + 2k / S),

a line in 1/S. This fits it per backend, head dim and direction (least squares on 1/rate) and
prints rate_inf, k and the worst miss; then what `opgraph/calibration.toml` takes for Hopper, at
head dim 128 (the reference `attention_exp_ratio` scales from): `attention` and
`attention_fused` as each backend's forward and backward together (the backward doing 2.5 x the
forward's FLOPs, as the calibration counts them), and one forward and one backward overhead for
both backends, their mean. tests/test_calibration.py checks the shipped values against it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "h200" / "results.json"
PEAK_TFLOPS = 989.0  # H200 SXM, BF16 dense
BACKWARD_RATIO = 2.5  # the backward's FLOPs over the forward's (calibration.py)
REFERENCE_HEAD_DIM = 128


def measurements(path: Path = RESULTS) -> list[dict]:
    return json.loads(Path(path).read_text())["run1"]["attention"]


def fit_line(seqs: list[float], rates: list[float]) -> tuple[float, float]:
    """(rate_inf, k) of 1 / rate = (1 / rate_inf)(1 + 2k / S), least squares in 1/S."""
    xs, ys = [1 / s for s in seqs], [1 / r for r in rates]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return 1 / intercept, slope / intercept / 2


def fits(rows: list[dict]) -> dict[tuple[str, int, str], tuple[float, float, float]]:
    """(backend, head dim, "fwd" | "bwd") -> (rate_inf, k, worst |predicted / measured - 1|)."""
    out = {}
    for backend, head_dim in sorted({(r["backend"], r["head_dim"]) for r in rows}):
        mine = sorted((r for r in rows if (r["backend"], r["head_dim"]) == (backend, head_dim)),
                      key=lambda r: r["seq"])
        seqs = [float(r["seq"]) for r in mine]
        for direction in ("fwd", "bwd"):
            rates = [r[f"{direction}_tflops"] / PEAK_TFLOPS for r in mine]
            rate_inf, k = fit_line(seqs, rates)
            worst = max(abs(rate_inf / (1 + 2 * k / s) / r - 1) for s, r in zip(seqs, rates))
            out[backend, head_dim, direction] = (rate_inf, k, worst)
    return out


def together(forward: float, backward: float) -> float:
    """A forward and its backward as one rate, the backward doing 2.5 x the forward's FLOPs."""
    return (1 + BACKWARD_RATIO) / (1 / forward + BACKWARD_RATIO / backward)


def shipped(found: dict) -> dict[str, float]:
    """What calibration.toml's Hopper table takes (see the module)."""
    def at(backend, direction):
        return found[backend, REFERENCE_HEAD_DIM, direction]

    return {
        "attention": together(at("flash", "fwd")[0], at("flash", "bwd")[0]),
        "attention_fused": together(at("cudnn", "fwd")[0], at("cudnn", "bwd")[0]),
        "attention_kv_overhead": (at("flash", "fwd")[1] + at("cudnn", "fwd")[1]) / 2,
        "attention_backward_kv_overhead": (at("flash", "bwd")[1] + at("cudnn", "bwd")[1]) / 2,
    }


def main(argv: list[str]) -> int:
    found = fits(measurements(Path(argv[0]) if argv else RESULTS))
    print(f"{'backend':<8} {'head dim':>8} {'direction':>9} {'rate_inf':>9} {'k (keys)':>9} "
          f"{'worst':>6}")
    for (backend, head_dim, direction), (rate_inf, k, worst) in found.items():
        print(f"{backend:<8} {head_dim:>8} {direction:>9} {rate_inf:>9.3f} {k:>9.0f} "
              f"{worst:>6.1%}")
    print()
    for name, value in shipped(found).items():
        print(f"hopper: {name} = {value:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
