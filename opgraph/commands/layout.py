"""The many-GPU options of `opgraph profile`: the parallel layout, the cluster, the rank whose
timeline is drawn, and the job configs users launch with (`--torchtitan`, `--megatron-args`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..core.choices import (ATTENTION_LIBRARIES, CP_COMMS, FRAMEWORKS, GRAD_REDUCE_DTYPES,
                            ZERO_STAGES)
from ..core.errors import OpgraphError
from ..core.limits import MAX_DIM, MAX_MICRO_BATCHES
from .args import layer_counts, whole

if TYPE_CHECKING:  # the record (with sympy) loads when a layout is made, not for --help
    from ..parallel.parallel import Parallel

SHARDING_FLAGS = (("tp", "tensor-parallel degree (Megatron-LM; heads, MLP width, vocabulary split)"),
                  ("cp", "context-parallel degree (ring attention)"),
                  ("ep", "expert-parallel degree (a mixture of experts' experts spread)"),
                  ("dp", "data-parallel degree (profile's default: gpus / (tp x pp x cp))"))
JOB_FLAGS = (("gpus", "GPUs in the job"),
             ("pp", "pipeline stages"),
             ("micro-batch", "sequences per micro-batch (default 1)"),
             ("global-batch", ("sequences per optimizer step over the job (default: one "
                              "micro-batch per data-parallel rank; at most "
                              f"{MAX_MICRO_BATCHES:,} micro-batches per rank)")),
             ("virtual-stages", "interleaved pipeline: model chunks per GPU (default 1)"))


def add_sharding_args(group) -> None:
    """The degrees that shard one GPU's step (`passes.shard`, `passes.replicate`), sequence
    parallelism and the ZeRO stage: what `formula` takes, and `profile` with the rest."""
    for flag, text in SHARDING_FLAGS:
        group.add_argument(f"--{flag}", type=whole(MAX_DIM), metavar="N", help=text)
    group.add_argument("--sequence-parallel", action="store_true",
                       help="with --tp: norms and residuals on a sequence shard, reduce-scatter "
                            "/ all-gather instead of all-reduce (Korthikanti et al. 2022)")
    group.add_argument("--zero", type=int, choices=ZERO_STAGES, metavar="{0,1,2,3}",
                       help="data-parallel sharding: 0 none (default), 1 optimizer states "
                            "(Megatron's distributed optimizer), 2 and gradients, 3 and "
                            "parameters (FSDP)")
    group.add_argument("--replicate", type=whole(MAX_DIM), metavar="N",
                       help="with --zero 1-3, HSDP: N replicas, each sharding over dp x cp / N "
                            "ranks, their gradient shards all-reduced across replicas "
                            "(torchtitan's data_parallel_replicate_degree; default 1)")
    add_framework_args(group)


def add_framework_args(group, search: bool = False) -> None:
    """`--framework`, `--grad-reduce-dtype`, `--attention-library`, `--cp-comm` and
    `--expert-tp` (`opgraph.parallel.frameworks`, `passes.shard`): what profile and plan follow
    beyond the degrees; a `search` (plan's) may try both context-parallel communications."""
    group.add_argument("--framework", choices=FRAMEWORKS,
                       help="follow this framework's behaviour (opgraph.parallel.frameworks): "
                            "FSDP2's gathers (torchtitan), Megatron-LM's sequence-parallel inputs, "
                            "DeepSpeed's reductions after the pipeline flush, each one's "
                            "gradient-reduction dtype; deepspeed-0.3 is DeepSpeed before v0.5.5, "
                            "whose ZeRO-3 calls copy each rank's piece apart and whose gathers "
                            "wait for the compute; deepspeed-bf16 is DeepSpeed's BF16 optimizer, "
                            "adding each micro-batch's gradients into FP32; torchtitan-2024 is "
                            "torchtitan before April 2025, whose torch.compile leaves the loss "
                            "eager; composer is Composer's FSDP1 (LLM Foundry) "
                            "(default: a generic FSDP-like model)")
    group.add_argument("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES,
                       help="the dtype gradients are reduced in across data-parallel ranks "
                            "(default: the framework's; fp32 without one)")
    group.add_argument("--attention-library", choices=ATTENTION_LIBRARIES,
                       help="the attention kernels the job runs: flash (FlashAttention-2), cudnn "
                            "(cuDNN's fused attention), triton (flash-attn's Triton "
                            "FlashAttention), flash1 (FlashAttention 1) (default: the "
                            "framework's; flash without one)")
    group.add_argument("--cp-comm", choices=CP_COMMS + (("both",) if search else ()),
                       help="with --cp: ring, each GPU's keys and values passed around the ring "
                            "(ring attention; Megatron-LM's p2p and allgather, torchtitan's); "
                            "a2a, an all-to-all to whole sequences of a head shard and back "
                            "(DeepSpeed-Ulysses, Megatron-LM's --cp-comm-type a2a)"
                            + ("; both, each at every context-parallel degree" if search
                               else "") + " (default ring)")
    group.add_argument("--expert-tp", type=_or_both(whole(MAX_DIM)) if search else whole(MAX_DIM),
                       metavar="N" + ("|both" if search else ""),
                       help="the experts' tensor-parallel degree: 1 leaves them whole and "
                            "spreads --ep over the tensor-parallel ranks too (Megatron-Core's "
                            "--expert-tensor-parallel-size 1, with --sequence-parallel)"
                            + ("; both, each way at every tensor-parallel degree" if search
                               else "") + " (default: split as --tp splits the rest)")


def _or_both(number):
    """An argparse type: `both`, or what `number` reads."""
    def parse(text: str):
        if text == "both":
            return text
        try:
            return number(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e}, or both") from None
    parse.__name__ = "whole number or both"
    return parse


class _OldRank(argparse.Action):
    """`profile --rank R`, read as `--trace-rank R` with one warning on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not getattr(namespace, "_warned_rank", False):
            print("opgraph: warning: profile --rank is now --trace-rank (plan's --rank ranks a "
                  "layout); read as --trace-rank", file=sys.stderr)
            namespace._warned_rank = True
        setattr(namespace, self.dest, values)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "many GPUs", "a training job over many GPUs: the step of one GPU (rank 0 unless "
                     "--trace-rank), scheduled over micro-batches and pipeline stages")
    add_sharding_args(g)
    for flag, text in JOB_FLAGS:
        g.add_argument(f"--{flag}", type=whole(MAX_DIM), metavar="N", help=text)
    g.add_argument("--async-tp", action="store_true",
                   help="overlap tensor-parallel communication with its matmul")
    g.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="reduce gradients after the backward, not under it (Megatron-LM's "
                        "default without --overlap-grad-reduce)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --zero 1 or 2, gather the updated weights under the next step's "
                        "first forward, not after the update (Megatron-LM's flag)")
    g.add_argument("--first-stage-layers", type=whole(MAX_DIM), metavar="N",
                   help="layers on the first pipeline stage (the rest split evenly)")
    g.add_argument("--last-stage-layers", type=whole(MAX_DIM), metavar="N",
                   help="layers on the last pipeline stage")
    g.add_argument("--stage-layers", type=layer_counts, metavar="A/B/...",
                   help="every pipeline stage's layers, first to last (6/5/5/0: nanotron's "
                        "split of a 16-layer model with its head on a stage of its own)")
    g.add_argument("--cluster", metavar="NAME|FILE",
                   help="the cluster (see `opgraph hardware --clusters`): a catalog id or a "
                        ".toml file (default: the hardware part's)")
    g.add_argument("--trace-rank", type=int, default=0, metavar="R",
                   help="the GPU whose timeline --trace draws (default 0)")
    # the flag's old name, still read (a script's command line keeps working), with a warning:
    # `plan --rank` ranks a layout, so one name must not mean a GPU here
    g.add_argument("--rank", type=int, dest="trace_rank", action=_OldRank,
                   help=argparse.SUPPRESS)
    g.add_argument("--torchtitan", metavar="TRAIN_TOML",
                   help="read the model, batch, degrees and options from a torchtitan job file "
                        "(a torchtitan job: --framework torchtitan unless given)")
    g.add_argument("--megatron-args", metavar="ARGS|@FILE",
                   help="read them from Megatron-LM's command-line arguments, or "
                        "Megatron-Bridge's run_recipe.py line (a quoted string, or @file; a "
                        "Megatron-LM job: --framework megatron unless given)")
    g.add_argument("--case", metavar="FILE:ID",
                   help="read the model, part, cluster, batch, degrees and options from a "
                        "run of a case file (FILE.json, or dev, holdout, playbook-sweep) by its "
                        "id; flags given beside it change them")


def given_layout(args) -> dict:
    """The layout fields the flags set: each `Parallel` field's flag of the same name (a flag
    left out, or a field without one, sets nothing); --no-overlap-grad-reduce clears one."""
    import attrs

    from ..parallel.parallel import Parallel

    given = {f.name: getattr(args, f.name) for f in attrs.fields(Parallel)
             if f.name != "overlap_grad_reduce"
             and getattr(args, f.name, None) not in (None, False)}
    if getattr(args, "no_overlap_grad_reduce", False):
        given["overlap_grad_reduce"] = False
    return given


def wants_layout(args) -> bool:
    """Whether any many-GPU option was given (else `profile` is the one-GPU step, as ever)."""
    return bool(given_layout(args) or getattr(args, "cluster", None)
                or getattr(args, "trace_rank", 0))


def is_job(args) -> bool:
    """Whether the options describe a job over many GPUs: a many-GPU option, or a launch
    config (`--torchtitan`, `--megatron-args`) or a case (`--case`) to read one from."""
    return bool(wants_layout(args) or getattr(args, "torchtitan", None)
                or getattr(args, "megatron_args", None) or getattr(args, "case", None))


def layout_from(args, seq_len: int, base: Parallel | None = None) -> Parallel:
    """The layout the flags give, over `base` (what a job config said); `--tokens` per step
    sets the global batch in sequences."""
    import attrs

    from ..parallel.parallel import Parallel

    given = given_layout(args)
    tokens = getattr(args, "tokens", None)
    if tokens is not None:
        if "global_batch" in given:
            raise OpgraphError("give --tokens or --global-batch, not both")
        if tokens % seq_len:
            raise OpgraphError(f"--tokens {tokens:,} is not a multiple of the sequence length "
                               f"{seq_len:,}")
        given["global_batch"] = tokens // seq_len
    if base is None:
        layout = Parallel(**given)
    else:
        if "gpus" in given and "dp" not in given and base.dp is not None:
            given["dp"] = None  # the GPUs decide the data-parallel degree again
        layout = attrs.evolve(base, **given)
    if layout.rank_stage(args.trace_rank) is None:
        raise OpgraphError(f"--trace-rank {args.trace_rank} is not a GPU of the job; give 0 to "
                           f"{layout.world - 1}")
    return layout


def layout_warnings(layout: Parallel) -> list[str]:
    """One line for each option the layout makes do nothing, or nearly: a ZeRO stage with no
    ranks to shard over (dp x cp = 1, `Parallel.size("dp")`), a pipeline with fewer
    micro-batches per step than stages (its bubble is (pp - 1) / (v x m) of the busy time,
    Narayanan et al. 2021: each stage idles (pp - 1) / (v x m + pp - 1) of the step)."""
    out = []
    if layout.zero and layout.size("dp") == 1:
        out.append(f"--zero {layout.zero} does nothing here: no other rank holds the same "
                   "weights to shard them with (dp x cp = 1); add data or context parallelism, "
                   "or leave out --zero")
    m, p, v = layout.micro_batches, layout.pp, layout.virtual_stages
    if p > 1 and m < p:
        out.append(f"{m} micro-batch{'es' if m > 1 else ''} per step through {p} pipeline "
                   f"stages: fewer micro-batches than stages, so each stage idles (pp - 1) / "
                   f"(v x m + pp - 1) = {(p - 1) / (v * m + p - 1):.0%} of the step; raise "
                   "--global-batch or lower --micro-batch")
    return out
