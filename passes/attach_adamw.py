"""attach_adamw: one AdamW update per parameter tensor, reading that parameter's gradient.

Invariant established: every weight with a gradient has exactly one `adamw` op (phase
`optimizer`, category `optimizer`, the weight's multiplicity); its FLOPs are `adamw`'s FLOP rule
(`flops_per_param` per element) and its traffic the tensors it touches. With the defaults, per
parameter (mixed-precision training, gradients accumulated in FP32 over micro-batches):

    reads   FP32 gradient 4, FP32 master weight 4, FP32 first and second moments 4 + 4   = 16
    writes  FP32 master weight 4, moments 4 + 4, the BF16 weight copy the next forward
            reads 2, and zeroes the FP32 gradient buffer for the next accumulation 4   = 18
                                                                                         -- 34

FLOPs per parameter (12, within the plate's 10-14): first moment m = b1*m + (1-b1)*g, 3;
second moment v = b2*v + (1-b2)*g*g, 4; decoupled weight decay p *= 1 - lr*wd, 1; the step
p -= a * m / (sqrt(v) + eps) with the bias corrections folded into the scalars a and eps:
sqrt, add, divide, and one fused multiply-subtract, 4.

The precisions are named options of the optimizer (`ADAMW_OPTIONS`, `AdamW.named`): "mixed"
(the above), "bf16-moments" (FP32 master, BF16 moments: 8 bytes of state per parameter),
"no-master" (the BF16 weights updated in place, FP32 moments: 8), "bf16" (no master, BF16
moments: 4) and "8bit" (FP32 master, 8-bit moments as bitsandbytes' AdamW8bit keeps them: 6;
its per-block scales, one FP32 number per 2,048 values, are not counted).
"""

from __future__ import annotations

import functools

import attrs

from opgraph.core.contracts import OPTIMIZER, contract, step_pass
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import BF16, FP32, DType, Graph, Op, Phase, Role, Tensor

from .derive_backward import gradient_of


@attrs.frozen
class AdamW:
    """The update's precisions and arithmetic; `AdamW(copy=None)` for a pure-FP32 run."""

    master: DType | None = FP32  # FP32 master weights; None: update the weight itself
    moments: DType = FP32
    copy: DType | None = BF16  # the low-precision weight the next forward reads
    zero_grad: bool = True  # zero the gradient buffer in the same pass
    flops_per_param: int = 12

    @classmethod
    def named(cls, name: str) -> AdamW:
        """A named option of ADAMW_OPTIONS: `AdamW.named("bf16-moments")`."""
        try:
            return ADAMW_OPTIONS[name]
        except KeyError:
            raise OpgraphError(f"unknown AdamW option {name!r}; choose one of "
                               f"{', '.join(ADAMW_OPTIONS)}") from None


UINT8 = DType("uint8", 1)  # an 8-bit optimizer state (blockwise-quantised, bitsandbytes)

ADAMW_OPTIONS: dict[str, AdamW] = {
    "mixed": AdamW(),
    "bf16-moments": AdamW(moments=BF16),
    "no-master": AdamW(master=None, copy=None),
    "bf16": AdamW(master=None, moments=BF16, copy=None),
    "8bit": AdamW(moments=UINT8),
}


def _state(graph: Graph, w: Tensor, base: str, suffix: str, dtype: DType,
           role: Role = Role.OPTIMIZER_STATE) -> str:
    """A new tensor shaped like weight `w`, e.g. its first moment `adamw.<w>.m`."""
    return graph.add_tensor(Tensor(f"{base}.{suffix}", w.shape, dtype, role, w.count,
                                   region=w.region)).name


@step_pass(at=OPTIMIZER, bind=lambda o: {"adamw": o.adamw or AdamW()})
@contract(requires=("backward",), forbids=("optimizer",))
def attach_adamw(graph: Graph, adamw: AdamW = AdamW()) -> Graph:
    """The graph with an AdamW update per weight: `attach_adamw(derive_backward(forward))`."""
    out = graph.copy()
    for w in graph.weights():
        grad = gradient_of(graph, w.name)
        if grad is None:
            if not any(op.phase is Phase.BACKWARD for op in graph.ops()):
                raise OpgraphError(f"{graph.name} has no backward: run derive_backward first")
            raise OpgraphError(f"weight {w.name} of {graph.name} is read by no op, so it gets "
                               "no gradient; use it in the model or leave it out")
        base = f"adamw.{w.name}"
        state = functools.partial(_state, out, w, base)
        reads, writes = [grad.name], []
        if adamw.master is not None:
            reads.append(state("master", adamw.master))
            writes.append(state("master'", adamw.master))
        else:
            reads.append(w.name)
            writes.append(state("weight'", w.dtype))
        for moment in ("m", "v"):
            reads.append(state(moment, adamw.moments))
            writes.append(state(f"{moment}'", adamw.moments))
        if adamw.copy is not None and adamw.master is not None:
            writes.append(state("weight'", adamw.copy))
        if adamw.zero_grad:
            writes.append(state("grad'", grad.dtype, Role.GRADIENT))
        out.add_op(Op(base, "adamw", "optimizer", reads, writes, count=w.count,
                      phase=Phase.OPTIMIZER,
                      params={"flops_per_param": adamw.flops_per_param,
                              "copy": adamw.copy is not None and adamw.master is not None,
                              "zero_grad": adamw.zero_grad},
                      region=w.region))
    return out
