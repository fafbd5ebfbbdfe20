"""Dimension symbols, declared once.

Every shape and cost in opgraph is a sympy expression over these positive-integer symbols.
A model's configuration gives their values; nothing is substituted until `evaluate`.
"""

import sympy

_DIM = {"positive": True, "integer": True}

B = sympy.Symbol("B", **_DIM)  # sequences per step (batch)
S = sympy.Symbol("S", **_DIM)  # sequence length
D = sympy.Symbol("D", **_DIM)  # model width, d_model
L = sympy.Symbol("L", **_DIM)  # layers in a stack
H = sympy.Symbol("H", **_DIM)  # query heads
H_kv = sympy.Symbol("H_kv", **_DIM)  # key/value heads (grouped-query attention)
d_h = sympy.Symbol("d_h", **_DIM)  # head dimension
F = sympy.Symbol("F", **_DIM)  # MLP hidden width, d_ff
V = sympy.Symbol("V", **_DIM)  # vocabulary size
E = sympy.Symbol("E", **_DIM)  # experts in a mixture-of-experts layer
K = sympy.Symbol("K", **_DIM)  # experts each token is routed to (top-k)

DIMENSIONS = (B, S, D, L, H, H_kv, d_h, F, V, E, K)
BY_NAME = {sym.name: sym for sym in DIMENSIONS}


def dim(name: str) -> sympy.Symbol:
    """A dimension symbol by name, declared like the standard ones: `dim("W")`."""
    return BY_NAME.get(name) or sympy.Symbol(name, **_DIM)
