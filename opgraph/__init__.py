"""opgraph: compile a network written as a symbolic op graph into a roofline profile.

    from opgraph import compile_step, evaluate, hardware
    from models import preset
    step = compile_step(preset("llama3-8b"))
    profile = evaluate(step, hardware.get("h100-sxm"))
    print(profile.step_time_s, profile.mfu_ceiling)
"""

from passes import evaluate

from . import hardware, symbols
from .builder import GraphBuilder
from .errors import OpgraphError
from .ir import BF16, FP32, Graph, Op, Phase, Role, Tensor
from .pipeline import compile_step, step_passes
from .verify import VerifyError, verify

__all__ = ["BF16", "FP32", "Graph", "GraphBuilder", "Op", "OpgraphError", "Phase", "Role",
           "Tensor", "VerifyError", "compile_step", "evaluate", "hardware", "step_passes",
           "symbols", "verify"]
