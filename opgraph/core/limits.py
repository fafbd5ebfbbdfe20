"""Upper bounds on the sizes a user may ask for, checked wherever a number comes in.

Every figure of a profile is computed in float64 (and a sweep's axes in int64), so a dimension
or a count must stay far from where those overflow or wrap: with every dimension at most
MAX_DIM (2**30, about a billion), tokens per step at most MAX_TOKENS (2**40, about 1.1 trillion)
and the hardware within `opgraph.cost.hardware`'s ranges, the largest FLOP count, byte count and
time stay below 1e60, and batch x seq_len below 2**63. The bounds are far above any real model
(Llama 3 405B: D = 16,384, L = 126, vocabulary 128,256).

    check_whole(8192, "--seq-len", MAX_DIM)      # 8192, or one OpgraphError line
"""

from __future__ import annotations

from .errors import OpgraphError

MAX_DIM = 2**30  # any model dimension: d_model, layers, heads, vocabulary, seq_len, batch
MAX_TOKENS = 2**40  # tokens per step (batch x seq_len)
MAX_COUNT = 2**40  # other counts: --steps, --rows
MAX_DIGITS = 20  # a whole number written with more digits than this is beyond every bound
CONFIG_MAX_BYTES = 1 << 20  # a config.json, a hardware TOML: a few KiB in practice
# Work that grows with a count the user gives, bounded so that a slip of the finger is refused
# at once rather than running for minutes. Each bound is far above real jobs.
# Micro-batches one data-parallel rank runs per step (global batch / (dp x micro-batch)): the
# drawn timeline holds every micro-batch's kernels, about 0.2 MB and 9 ms each on Llama 3 8B,
# so 4,096 take about 0.9 GB and 35 s. Llama 3 405B's 2,048 sequences per step (arXiv:2407.21783
# sec. 3.4) fit on a single data-parallel rank.
MAX_MICRO_BATCHES = 2**12
# Layers of a model on many GPUs: the schedule runs a micro-batch layer by layer where its
# layer stack reaches no steady state (a data-parallel queue that grows every layer), so its
# work grows with them: 20,000 layers of a small model on 8 GPUs took 12 s on a 2-core
# machine, 100,000 two minutes. The deepest transformers trained have 1,000 (DeepNet,
# arXiv:2203.00555); Llama 3 405B has 126.
MAX_LAYERS = 2**14
# Layouts one `plan --compare` / `--compare-config` names, each profiled on its own (a compile,
# up to seconds for the largest models).
MAX_COMPARED = 64
# Job sizes one `plan --gpus START:STOP:STEP` searches, each a full search: 64 holds every
# doubling from 1 to MAX_DIM GPUs (31 sizes) twice over.
MAX_PLAN_SIZES = 64
# Cases one `calibrate --fit` fits to, each profiled at every step of the optimizer (about
# 0.12 s a case a step); the shipped file has 21.
MAX_FIT_CASES = 500
# What a trace may hold once decompressed. A step of 1,000,000 kernels exported by Kineto is about
# 0.7 GB of JSON; twice that and more is an endless or inflating input, unless the user says so.
MAX_TRACE_BYTES = 2_000_000_000


def check_whole(value: int, what: str, maximum: int) -> int:
    """`value` if it is a whole number from 1 to `maximum`, else one line saying the bound."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpgraphError(f"{what} {value!r} is not a whole number")
    if value <= 0:
        raise OpgraphError(f"{what} {value} is not positive")
    if value > maximum:
        shown = (f"{value:,}" if value < 10**MAX_DIGITS
                 else f"(a number of about {int(value.bit_length() * 0.30103) + 1:,} digits)")
        raise OpgraphError(f"{what} {shown} is more than opgraph's bound of {maximum:,} "
                           f"(2**{maximum.bit_length() - 1}); give a smaller value")
    return value


__all__ = ["CONFIG_MAX_BYTES", "MAX_COUNT", "MAX_DIGITS", "MAX_DIM", "MAX_FIT_CASES",
           "MAX_LAYERS", "MAX_MICRO_BATCHES", "MAX_PLAN_SIZES", "MAX_TOKENS", "MAX_TRACE_BYTES",
           "check_whole"]
