"""opgraph: compile a network written as a symbolic op graph into a roofline profile.

    from opgraph import compile_step, evaluate, hardware
    from opgraph.models import preset
    step = compile_step(preset("llama3-8b"))
    profile = evaluate(step, hardware.get("h100-sxm"))
    print(profile.step_time_s, profile.mfu_ceiling)
"""

from pathlib import Path as _Path

from . import _checkout

_checkout.install(_Path(__file__).resolve().parent)

from . import hardware, symbols
from .builder import GraphBuilder
from .costmodel import CostModel
from .errors import OpgraphError
from .ir import BF16, FP32, Graph, Op, Phase, Role, Tensor
from .passes.attach_adamw import AdamW, attach_adamw
from .passes.derive_backward import derive_backward
from .passes.evaluate import evaluate
from .passes.fuse_attention import fuse_attention
from .passes.fuse_elementwise import fuse_elementwise
from .passes.precision import apply_precision
from .passes.recompute import recompute
from .pipeline import compile_step, step_passes
from .verify import VerifyError, verify

__version__ = "0.2.0"

__all__ = ["BF16", "FP32", "AdamW", "CostModel", "Graph", "GraphBuilder", "Op", "OpgraphError", "Phase", "Role",
           "Tensor", "VerifyError", "__version__", "apply_precision", "attach_adamw",
           "compile_step", "derive_backward", "evaluate", "fuse_attention", "fuse_elementwise",
           "hardware", "recompute", "step_passes", "symbols", "verify"]
