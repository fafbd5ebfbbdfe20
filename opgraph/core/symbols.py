"""Dimension and parallel-degree symbols, declared once.

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
W = sympy.Symbol("W", **_DIM)  # sliding attention window: keys each query sees at most
M = sympy.Symbol("M", **_DIM)  # masked positions per sequence (a masked-LM's predictions)
F_e = sympy.Symbol("F_e", **_DIM)  # one routed expert's MLP width (moe_intermediate_size)
F_s = sympy.Symbol("F_s", **_DIM)  # a shared expert's MLP width (shared_expert_intermediate_size)
r_kv = sympy.Symbol("r_kv", **_DIM)  # MLA: the compressed K/V width (kv_lora_rank)
d_nope = sympy.Symbol("d_nope", **_DIM)  # MLA: each head's query/key part without RoPE
d_rope = sympy.Symbol("d_rope", **_DIM)  # MLA: each head's query/key part with RoPE
d_v = sympy.Symbol("d_v", **_DIM)  # a value head's size, where it is not d_h
# Mamba-2 (Dao and Gu 2024, arXiv:2405.21060): its mixer's heads, each head's width, the state
# per head dimension (d_state), the groups that share B and C (n_groups), the chunk length of the
# scan (chunk_size) and the causal convolution's width (d_conv)
H_m = sympy.Symbol("H_m", **_DIM)
d_m = sympy.Symbol("d_m", **_DIM)
N_m = sympy.Symbol("N_m", **_DIM)
G_m = sympy.Symbol("G_m", **_DIM)
Q_m = sympy.Symbol("Q_m", **_DIM)
k_m = sympy.Symbol("k_m", **_DIM)

DIMENSIONS = (B, S, D, L, H, H_kv, d_h, F, V, E, K, W, M, F_e, F_s, r_kv, d_nope, d_rope,
              d_v, H_m, d_m, N_m, G_m, Q_m, k_m)
BY_NAME = {sym.name: sym for sym in DIMENSIONS}

# The parallel degrees (`opgraph.parallel.parallel`), like the dimensions: formulas show them,
# sweeps vary them.
tp = sympy.Symbol("tp", **_DIM)  # tensor parallel (Megatron-LM)
cp = sympy.Symbol("cp", **_DIM)  # context parallel (ring attention)
ep = sympy.Symbol("ep", **_DIM)  # expert parallel
pp = sympy.Symbol("pp", **_DIM)  # pipeline stages
dp = sympy.Symbol("dp", **_DIM)  # data parallel (plain, ZeRO-1/2/3, FSDP)
# The ranks that hold the same expert weights and reduce their gradients: dp x cp / ep
# (Megatron-LM's expert data-parallel group).
edp = sympy.Symbol("edp", **_DIM)


def dim(name: str) -> sympy.Symbol:
    """A dimension symbol by name, declared like the standard ones: `dim("W")`."""
    return BY_NAME.get(name) or sympy.Symbol(name, **_DIM)
