"""opgraph: compile a network written as a symbolic op graph into a roofline profile.

    from opgraph import compile_step, evaluate, hardware
    from opgraph.models import preset
    step = compile_step(preset("llama3-8b"))
    profile = evaluate(step, hardware.get("h100-sxm"))
    print(profile.step_time_s, profile.mfu_ceiling)

The names below load on first use (PEP 562), so that `opgraph --help` and a mistyped flag
return before sympy, networkx and numpy are imported; `from opgraph import evaluate` reads
exactly as before.
"""

import importlib as _importlib
from pathlib import Path as _Path

from . import _checkout

_checkout.install(_Path(__file__).resolve().parent)

__version__ = "0.2.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "BF16": ".core.ir", "FP32": ".core.ir", "Graph": ".core.ir", "Op": ".core.ir",
    "Phase": ".core.ir", "Role": ".core.ir", "Tensor": ".core.ir",
    "AdamW": ".passes.attach_adamw", "attach_adamw": ".passes.attach_adamw",
    "CostModel": ".cost.costmodel",
    "Lowered": ".cost.lowered", "lower": ".cost.lowered",
    "GraphBuilder": ".core.builder",
    "OpgraphError": ".core.errors",
    "VerifyError": ".core.verify", "verify": ".core.verify",
    "apply_precision": ".passes.precision",
    "compile_step": ".core.pipeline", "step_passes": ".core.pipeline",
    "derive_backward": ".passes.derive_backward",
    "evaluate": ".passes.evaluate",
    "fuse_attention": ".passes.fuse_attention",
    "fuse_elementwise": ".passes.fuse_elementwise",
    "recompute": ".passes.recompute",
}
_SUBMODULES = {"hardware": ".cost.hardware", "symbols": ".core.symbols"}

__all__ = ["BF16", "FP32", "AdamW", "CostModel", "Graph", "GraphBuilder", "Lowered", "Op",
           "OpgraphError", "Phase", "Role", "Tensor", "VerifyError", "__version__",
           "apply_precision", "attach_adamw", "compile_step", "derive_backward", "evaluate",
           "fuse_attention", "fuse_elementwise", "hardware", "lower", "recompute", "step_passes",
           "symbols", "verify"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return _importlib.import_module(_SUBMODULES[name], __name__)
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
