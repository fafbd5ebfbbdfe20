"""How often Python's cyclic garbage collector runs while opgraph compiles and searches.

Compiling a step (the passes, sympy's expressions) and searching layouts allocate millions of
small objects that reference counting frees, few of them in cycles; the collector's default
thresholds (700 allocations for a young collection) then traverse the long-lived graphs and
formulas again and again. `fewer_collections` raises the young generation's threshold to 200,000,
as mypy's build does for the same reason ("otherwise we can spend a large fraction of cpu in gc",
`mypy/build.py`), for the duration of a block, and restores the thresholds after it. Measured on
this project's machine (`opgraph plan`, whole process, no plan cache): Llama 3 8B on 64 GPUs 2.40
-> 2.08 s, Llama 3 70B on 256 6.14 -> 5.34 s, Llama 3.1 405B on 16,384 3.25 -> 2.90 s, one
`opgraph profile` 0.59 -> 0.56 s; the peak resident memory of each within 2 MB of before. Cycles
are still collected, less often.

It also freezes (`gc.freeze`, made for long-lived objects that need no traversal) what is alive
when a block starts, so that a collection inside the block traverses only what the block made:
the second search of one process does not traverse the structures the first one compiled
(`benchmarks/bench_plan.py` (a), Llama 3 8B on 64 GPUs: a search after compile 0.59 -> 0.49 s,
the same as with the first search's garbage collected beforehand). Whole `plan` processes and
peak memory move by less than their noise (8B on 64 GPUs 1.60 -> 1.54 s, 70B on 256 4.71 ->
4.74 s; 2 MB). What is frozen and becomes cyclic garbage waits for the outermost block's end.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

THRESHOLDS = (200_000, 30, 30)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the block with the collector's thresholds at `THRESHOLDS` (or the caller's where
    they are higher already), and with every object alive at its start frozen (`gc.freeze`:
    no collection inside the block traverses them), then as they were: the thresholds
    restored, and at the outermost block's end every object unfrozen. A block inside another
    freezes what the outer one made so far (the structures a search compiled before the next
    search of one `opgraph plan`). Where the caller froze objects of its own, nothing is
    frozen or unfrozen."""
    global _depth, _freezing
    before = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(before, THRESHOLDS)))
    if not _depth:
        _freezing = gc.get_freeze_count() == 0
    if _freezing:
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _freezing:
            gc.unfreeze()
        gc.set_threshold(*before)


_depth = 0  # blocks open
_freezing = False  # whether the outermost open block freezes
