"""Plan a run: every parallel layout of a model on a number of GPUs, ranked by tokens per second
per GPU (`opgraph plan`).

    from opgraph import hardware
    from opgraph.models import preset
    from opgraph.parallel.search import Space, search
    found = search(preset("llama3-8b"), hardware.get("h100-sxm"), Space(gpus=64, batch=256))
    found.best[0].layout, found.best[0].step_time_s

**The space** (`Space`, `rows`): tensor parallelism within a node (powers of two that the heads
and widths divide); context parallelism (powers of two whose two ring-attention chunks per GPU
divide the sequence, while a GPU keeps `MIN_CP_TOKENS` of it); expert parallelism for a mixture
of experts (powers of two dividing the experts and dp x cp); pipeline stages that split the
layers evenly or, as Llama 3 405B did, with one layer fewer on the first and the last stage;
data parallelism takes the GPUs left, and must divide the batch. Then every ZeRO stage (where
there is data parallelism), micro-batch (the divisors of each rank's sequences, up to
`max_micro_batch`), interleaving (even stages only, micro-batches a multiple of the stages, as
Megatron-LM requires), recomputation policy, sequence parallelism (with tensor parallelism) and
precision (FP8 where the part has an FP8 peak). Constraints fix or bound any of them. A layout
is a `Row` while searched (tens of thousands are), a `Candidate` (a `Parallel` and the step's
options) when returned.

**Compiled once per structure, evaluated as arrays.** Which degrees exceed 1, sequence
parallelism, the ZeRO stage, recomputation, precision and whether there are one, two or more
pipeline stages decide which ops and collectives the step has (its *structure*); the degrees'
values, the split and the micro-batch only change numbers. Each structure is compiled once, by
the passes `profile` runs (`pipeline.step_passes`; a pass shared by several structures runs
once), its stages cut by `split_stages` with the stack's trip count a symbol (`LAYERS`), and
every op's count, FLOPs, bytes and message, every tensor's size and count in the liveness
analysis and the resident memory kept as formulas of `DEGREES`. Over all of a structure's rows
at once, those formulas are evaluated on numpy arrays (`_Program`; once per distinct set of the
degrees, micro-batch and split, which rows differing only in their micro-batch or
virtual-stage counts share, then spread over the rows), and from them:

- memory per GPU: each stage's liveness peak (`Liveness.copy_matrices`: each op's live bytes as
  a matrix product over the lives) and, for each further micro-batch in flight
  (`distributed.in_flight`), the activations live at its backward's start, the fullest
  stage's; rows that do not fit are dropped;
- a lower bound of the step (`_step_bound`): from lower bounds of each stage's plain and last
  micro-batch — its compute plus the communication the stream surely waits for
  (`schedule.sure_waits`: a chain of tensor- or expert-parallel collectives from one op of a
  layer to another, less the ops that run between them; a mixture of experts' all-gather and
  all-to-all), the
  optimizer in the last, each communication stream's collectives after the compute that
  releases them (`schedule.released_bound`), and each layer stack's trips held back by the
  data-parallel stream (`schedule.cycle_bound`: under ZeRO-3 a backward layer's gradient
  reductions and the next layer's gathers queue on it between one trip and the next) —
  through the pipeline span and the tail, as
  `distributed.step_figures` combines them. For the fastest layouts of Llama 3 8B on 64 GPUs
  and of Llama 3.1 405B on 16,384 it is 1.9% and 1.0% below the step.

**A bound before compiling.** A structure's compile costs about 50 ms on this machine's core
and a large space has hundreds of structures (four ZeRO stages x four recomputation policies x
two precisions x ...), most of which cannot hold the best layout. So every row first gets a
bound from far less (`_compute_bound`): the step before `replicate` and `split_stages`, one per
*compute key* (`compute_key`: the structure less the ZeRO stage, data parallelism and the
pipeline depth, which leave every forward and backward op as it is), costed once per key. A
stage's micro-batch takes at least its layer stack's compute ops times its layers, its ends'
ops and the stack's surely-waited collectives, and at least what ZeRO-2/3 move on a
data-parallel stream every micro-batch (`_moved`: each weight gathered once per phase that
reads it, each gradient reduce-scattered), through the same `_step_bound`; and a stage
holds at least its layers' weights, gradients and optimizer states as the ZeRO stage shards
them, and the activations they save (`_held`): a row that surely does not fit is out. Both read
a subset of what the compiled structure's arrays read (a test checks them below those, on
every row of random structures).

**Exact figures by branch and bound.** Structures, at their rows' least compute bound, and the
fitting rows of the structures evaluated, at their bound, are taken best first: a structure is
compiled and evaluated when it comes up, and a row is scheduled exactly, by the critical path
`opgraph profile` runs (`distributed.step_figures`, `schedule.simulate`) on the numbers the
arrays gave, with its memory made whole as `memory.figures` makes it, until nothing left has
a bound below the K-th best step found. So the layouts returned carry `profile`'s figures (a
test compares random layouts of many structures with `profile` itself, relative 1e-9, and
another the top K with every layout of a small space scheduled), every layout not returned is
no faster than the last one returned, and only the structures that might hold a better one are
compiled: 5 of 512 for Llama 3.1 405B on 16,384 GPUs. Ties are broken by the order the space
lists the rows, so the answer does not depend on what was pruned.

**Where a layout ranks** (`--rank`, `Searcher.faster_than`) counts the layouts faster than it.
A row whose upper bound is below its step is counted unscheduled: every op of each micro-batch
run one at a time (the critical path never leaves every stream idle while an op is left, so
it is no longer than that), through the pipeline span, the longest tail and the overlap
slowdown on all the communication (`_step_upper`). Only the rows between the two bounds are
scheduled exactly: for the README's Llama 3 layout 414 of the 568 faster are counted under
their upper bound, and 280 scheduled, against 694 without it.

**Kept between runs** (`cache.py`): `opgraph plan` writes the structures it compiled to a
file named by a digest of everything they depend on (the code, the model, the part, the cost
model, the sequence length), and a later run of the same context reads them back instead of
compiling them; a stage's graph is left out of the file and made again, checked against the
cached formulas, for the few layouts scheduled exactly.

The package: `space.py` (the constraints, the records of a layout, every layout of a job),
`bounds.py` (structures compiled into formulas, evaluated as arrays; memory and the bounds of
the step), `searcher.py` (branch and bound: `Searcher`, `search`), `cache.py` (compiled
structures kept between runs).
"""

from __future__ import annotations

from .bounds import compute_key
from .searcher import Searcher, search
from .space import (
                    DEGREES,
                    LAYERS,
                    MIN_CP_TOKENS,
                    RECOMPUTE,
                    Candidate,
                    Found,
                    Ranked,
                    Row,
                    Space,
                    row_of,
                    rows,
                    structure,
                    unsplit_degrees,
)

__all__ = [
    "DEGREES",
    "LAYERS",
    "MIN_CP_TOKENS",
    "RECOMPUTE",
    "Candidate",
    "Found",
    "Ranked",
    "Row",
    "Searcher",
    "Space",
    "compute_key",
    "row_of",
    "rows",
    "search",
    "structure",
    "unsplit_degrees",
]
