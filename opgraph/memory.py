"""The step's HBM footprint, derived from the graph's tensors: who they are and who reads them.

At the start of the backward pass everything below is resident at once, so their sum is the
step's peak need (one device, no sharding, no activation checkpointing):

- weights: every weight tensor, in its own dtype (BF16 by default);
- gradients: one buffer per weight, in its gradient's dtype (FP32 by default: the buffer
  gradients accumulate in); the partial gradients of a weight read twice are that same buffer;
- optimizer: the optimizer states the update reads (FP32 master weights and AdamW's two
  moments by default, 12 bytes per parameter); what it writes updates them in place;
- activations: the forward tensors a backward kernel reads (activations and the step's inputs,
  deduplicated), times their multiplicity, so `L` layers keep `L` copies.

Transient buffers (activation gradients, a kernel's workspace) are not counted: they live for
a layer or a kernel at a time, and allocators reuse them.

    fp = footprint(compile_step(preset("llama3-8b")))
    fp.total  # a sympy expression of the dimensions
"""

from __future__ import annotations

import attrs
import sympy

from .ir import Graph, Phase, Role, Tensor

PARTS = ("weights", "gradients", "optimizer", "activations")


@attrs.frozen
class Footprint:
    """Bytes resident at the step's peak, per part, as expressions of the dimensions."""

    weights: sympy.Expr
    gradients: sympy.Expr
    optimizer: sympy.Expr
    activations: sympy.Expr

    @property
    def total(self) -> sympy.Expr:
        return self.weights + self.gradients + self.optimizer + self.activations

    def parts(self) -> dict[str, sympy.Expr]:
        return {name: getattr(self, name) for name in PARTS}


def _resident(tensors: list[Tensor]) -> sympy.Expr:
    return sympy.Add(*(t.nbytes * t.count for t in tensors))


def footprint(graph: Graph) -> Footprint:
    """The HBM footprint of a step graph (a forward graph has no gradients, states or saved
    activations): `footprint(step).total`."""
    weights = graph.weights()
    names = {w.name for w in weights}
    grads: dict[str, Tensor] = {}
    for t in graph.tensors():  # one buffer per weight, however many partials write it
        if t.role is Role.GRADIENT and t.grad_of in names:
            grads.setdefault(t.grad_of, t)
    states: dict[str, Tensor] = {}
    saved: dict[str, Tensor] = {}
    for op in graph.ops():
        for name in op.inputs:
            t = graph.tensor(name)
            if op.phase is Phase.OPTIMIZER and t.role is Role.OPTIMIZER_STATE:
                states.setdefault(name, t)
            elif op.phase is Phase.BACKWARD and t.role in (Role.ACTIVATION, Role.INPUT):
                saved.setdefault(name, t)
    return Footprint(_resident(weights), _resident(list(grads.values())),
                     _resident(list(states.values())), _resident(list(saved.values())))


@attrs.frozen
class Memory:
    """A footprint evaluated, in bytes, against the part's `capacity` (None if unknown);
    `fits` is None where the capacity is unknown."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    capacity: int | None = None

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def fits(self) -> bool | None:
        return self.total <= self.capacity if self.capacity else None

    def to_json(self) -> dict:
        """The JSON `memory` object: bytes per part, `total`, `capacity`, `fits`."""
        return {**{name: getattr(self, name) for name in PARTS}, "total": self.total,
                "capacity": self.capacity, "fits": self.fits}


def figures(parts: dict[str, int], capacity: float | None) -> Memory:
    """The evaluated parts (bytes per part of PARTS) against the part's `capacity`."""
    return Memory(**{name: parts[name] for name in PARTS},
                  capacity=int(capacity) if capacity else None)
