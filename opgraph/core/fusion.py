"""Fusion policies: which op kinds may share a kernel, as data a user can change.

A policy sorts kinds into classes and says which (producer class, consumer class) pairs may be
fused along a dataflow edge, and how many library matmuls one kernel may hold. The pass that
reads it is `opgraph.passes.fuse_elementwise`; a kind the policy does not list never fuses. Backward
kernels take their forward kind's class, and a pair is read against the dataflow for them: where an
add may feed a norm, the norm's backward may feed the add's.

    ELEMENTWISE                    # torch.compile's default: nothing fuses into a library matmul
    ELEMENTWISE_MATMUL             # also prologues and epilogues of one matmul (Triton templates)
    mine = ELEMENTWISE.with_kinds(embedding="pointwise")   # let the gather fuse into its reader
    mine = ELEMENTWISE.without_pairs(("reduction", "reduction"))   # no norm chains

Classes:

- "pointwise": element-wise ops (residual adds, RoPE, activations) and their backward kernels;
- "reduction": row-wise reductions (norms, the loss, the experts' weighted sum) and theirs:
  a norm reduces over the width of one token's row, so it fuses with the element-wise ops
  around it the way XLA's "loop" and "input" fusions and TorchInductor's pointwise/reduction
  kernels do;
- "matmul": library GEMMs (`matmul`, `expert_matmul`, the unfused attention's QK^T).

Kinds left out by default: FlashAttention (already one library kernel), the embedding gather,
the router's top-k and the optimizer's update.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .errors import OpgraphError
from . import rules
from .rules import FLOP_RULES

CLASSES = ("pointwise", "reduction", "matmul")


def _with_backward(table: Mapping[str, str]) -> dict[str, str]:
    """Each forward kind's class given to its `<kind>_backward` kernel too (where one exists):
    backward kernels fuse by the same rules as their forwards."""
    out = dict(table)
    for kind, cls in table.items():
        if f"{kind}_backward" in FLOP_RULES:
            out.setdefault(f"{kind}_backward", cls)
    return out


def _frozen_kinds(value) -> tuple[tuple[str, str], ...]:
    items = dict(value.items() if isinstance(value, Mapping) else value)
    return tuple(sorted((str(k), str(v)) for k, v in _with_backward(items).items()))


def _frozen_pairs(value) -> frozenset[tuple[str, str]]:
    return frozenset((str(a), str(b)) for a, b in value)


@attrs.frozen
class FusionPolicy:
    """Which kinds may share a kernel: `kinds` maps a kind to its class (a kind's backward
    kernel, `<kind>_backward`, gets the same class unless it is given one), `pairs` holds the
    (producer class, consumer class) edges that may be fused, `max_matmuls` bounds the library
    matmuls in one kernel.

        >>> FusionPolicy("add+norm", {"add": "pointwise", "rmsnorm": "reduction"},
        ...              {("pointwise", "reduction")}).may_fuse("add", "rmsnorm")
        True
    """

    name: str
    kinds: tuple[tuple[str, str], ...] = attrs.field(converter=_frozen_kinds)
    pairs: frozenset[tuple[str, str]] = attrs.field(converter=_frozen_pairs)
    max_matmuls: int = 0
    # whether kinds defined after it (`kinds.define_kind(fusion_class=...)`, `DEFINED_CLASSES`)
    # take their declared class: the built-in policies do, a policy of your own names its own
    defined: bool = False

    def __attrs_post_init__(self):
        unknown = {c for _, c in self.kinds} | {c for pair in self.pairs for c in pair}
        unknown -= set(CLASSES)
        if unknown:
            raise OpgraphError(f"fusion policy {self.name}: unknown classes {sorted(unknown)}; "
                             f"use {', '.join(CLASSES)}")

    def kind_class(self, kind: str) -> str | None:
        """The class of `kind`, None if it never fuses."""
        found = dict(self.kinds).get(kind)
        if found is None and self.defined:
            return DEFINED_CLASSES.get(kind)
        return found

    def may_fuse(self, producer: str, consumer: str) -> bool:
        """Whether an op of kind `producer` may share a kernel with an op of kind `consumer`
        that reads its output."""
        a, b = self.kind_class(producer), self.kind_class(consumer)
        return a is not None and b is not None and (a, b) in self.pairs

    def with_kinds(self, **kinds: str) -> FusionPolicy:
        """This policy with more kinds (or other classes for some): `with_kinds(gelu="pointwise")`.
        A kind's backward kernel gets the same class."""
        table = {**dict(self.kinds), **kinds}
        return attrs.evolve(self, name=f"{self.name}+kinds", kinds=table)

    def without_kinds(self, *kinds: str) -> FusionPolicy:
        """This policy with `kinds` (and their backward kernels) never fused."""
        drop = set(kinds) | {f"{k}_backward" for k in kinds}
        return attrs.evolve(self, name=f"{self.name}-kinds",
                            kinds={k: c for k, c in self.kinds if k not in drop})

    def with_pairs(self, *pairs: tuple[str, str]) -> FusionPolicy:
        return attrs.evolve(self, name=f"{self.name}+pairs", pairs=self.pairs | set(pairs))

    def without_pairs(self, *pairs: tuple[str, str]) -> FusionPolicy:
        return attrs.evolve(self, name=f"{self.name}-pairs", pairs=self.pairs - set(pairs))


# Kind -> class for the built-in kinds, their backward kernels included (each kind's
# `fusion_class`, declared in its family's module of `opgraph.core.rules`).
KIND_CLASSES: dict[str, str] = dict(rules.FUSION_CLASSES)

_VECTOR = ("pointwise", "reduction")
VECTOR_PAIRS = frozenset((a, b) for a in _VECTOR for b in _VECTOR)
# A matmul's prologue (an element-wise or norm producer read as it loads) and epilogue (its
# output transformed before it is stored), never two matmuls in one kernel.
MATMUL_PAIRS = frozenset({(c, "matmul") for c in _VECTOR} | {("matmul", c) for c in _VECTOR})

# Kind -> class for kinds made by `kinds.define_kind(fusion_class=...)` (and their backward
# kernels), which the built-in policies read as they read their own.
DEFINED_CLASSES: dict[str, str] = rules.DEFINED_FUSION_CLASSES

ELEMENTWISE = FusionPolicy("elementwise", KIND_CLASSES, VECTOR_PAIRS, max_matmuls=0,
                           defined=True)
ELEMENTWISE_MATMUL = FusionPolicy("elementwise+matmul", KIND_CLASSES,
                                  VECTOR_PAIRS | MATMUL_PAIRS, max_matmuls=1, defined=True)

# The policies the command line names (`--fuse elementwise`).
POLICIES: dict[str, FusionPolicy] = {p.name: p for p in (ELEMENTWISE, ELEMENTWISE_MATMUL)}


__all__ = ["CLASSES", "ELEMENTWISE", "ELEMENTWISE_MATMUL", "KIND_CLASSES", "POLICIES",
           "FusionPolicy"]
