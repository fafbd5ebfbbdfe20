"""The standard pipeline: a forward graph in, one training step's graph out.

    step = compile_step(preset("llama3-8b"))           # fused attention, backward, AdamW
    step = compile_step(forward, fused_attention=False)

It is a plain list of passes; each is a pure function Graph -> Graph.
"""

from __future__ import annotations

import functools

from .ir import Graph
from .passes.attach_adamw import AdamW, attach_adamw
from .passes.derive_backward import derive_backward
from .passes.fuse_attention import fuse_attention
from .verify import verify

DEFAULT_ADAMW = AdamW()


def step_passes(*, fused_attention: bool = True, backward_traffic: str = "plate",
                adamw: AdamW = DEFAULT_ADAMW) -> list:
    """The passes `compile_step` runs, in order."""
    passes = [fuse_attention] if fused_attention else []
    passes.append(functools.partial(derive_backward, traffic=backward_traffic))
    passes.append(functools.partial(attach_adamw, adamw=adamw))
    return passes


def compile_step(forward: Graph, *, check: bool = False, **options) -> Graph:
    """Run `step_passes(**options)` over `forward`; with `check=True` verify after each."""
    graph = forward
    for run in step_passes(**options):
        graph = run(graph)
        if check:
            verify(graph)
    return graph
