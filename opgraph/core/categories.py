"""The one vocabulary of cost categories, shared by the roofline and the trace reader.

The roofline (`opgraph.cost.profile`, `passes/evaluate.py`) puts every op of a step into one of
``CATEGORIES``; the trace reader (`opgraph.analysis.traces.rules`) sorts every GPU kernel of a
measured step into the same names, plus the few only a trace has (``TRACE_ONLY``): collectives,
memory copies and sets, and whatever a kernel's name does not tell apart. A kernel category is then
its roofline category of the same name, except where the kernels cannot say which roofline category
they implement (``KERNELS_COVER``: a matrix multiply may be a projection or the output head).

>>> [c for c in ALL if c not in CATEGORIES]
['communication', 'memory', 'other']
>>> KERNELS_COVER["matmul"]
('matmul', 'output_head')
"""

from __future__ import annotations

# The roofline's categories, in the order reports list them.
CATEGORIES = ("matmul", "attention", "scan", "norm", "elementwise", "routing", "output_head", "embedding",
              "optimizer")

# Categories only a measured trace has: the roofline models none of them.
TRACE_ONLY = ("communication", "memory", "other")

# Every category, roofline first.
ALL = CATEGORIES + TRACE_ONLY

# The category of a kernel no rule recognises (and of reductions and softmax, whose name does not
# say whether they belong to attention, a norm or the loss).
FALLBACK = "other"

DESCRIPTIONS = {
    "matmul": "matrix multiplies: projections, MLPs, experts (and, in a trace, convolutions)",
    "attention": "the attention core: scores, softmax and the weighted sum, fused or not",
    "scan": "a state-space mixer's scan and its causal convolution (Mamba-2's SSD)",
    "norm": "layer and RMS norms (batch and group norms in a trace)",
    "elementwise": "pointwise kernels: activations, residual adds, dropout, casts and copies",
    "routing": "a mixture of experts' router: top-k selection and the combine",
    "output_head": "the output head's matrix multiply and the loss",
    "embedding": "embedding lookups and their backward",
    "optimizer": "the optimizer's update of every parameter",
    "communication": "collectives and point-to-point transfers (NCCL, RCCL)",
    "memory": "memory copies and sets (memcpy, memset)",
    "other": "reductions, softmax, sorts and kernels no rule recognises",
}

# Kernel category -> the roofline categories its kernels implement; every other roofline category
# is measured by the kernel category of the same name, and TRACE_ONLY ones by none.
KERNELS_COVER: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in CATEGORIES if name != "output_head"},
    "matmul": ("matmul", "output_head"),
    **{name: () for name in TRACE_ONLY},
}
