"""Passes: pure functions from graph to graph, and `evaluate` from graph to profile."""

from .attach_adamw import AdamW, attach_adamw
from .derive_backward import derive_backward, gradient_of
from .evaluate import evaluate
from .fuse_attention import fuse_attention, rewrite_attention

__all__ = ["AdamW", "attach_adamw", "derive_backward", "evaluate", "fuse_attention", "gradient_of",
           "rewrite_attention"]
