"""Llama 3 (and its relatives) as an op graph, from its configuration.

One op per kernel of a straightforward implementation (PLATE.md): per layer RMSNorm; Q, K, V
projections; RoPE on Q and K; the attention core (scores, then P.V); O projection; residual add;
RMSNorm; gate and up projections; SwiGLU; down projection; residual add. Around the stack: the
embedding lookup, the final RMSNorm, the output head and the cross-entropy loss.

The graph's shapes are symbols (`opgraph.symbols`); the configuration supplies their values.
"""

from __future__ import annotations

import attrs

from opgraph.builder import GraphBuilder
from opgraph.ir import Graph
from opgraph.symbols import B, D, F, H, H_kv, L, S, V, d_h


@attrs.frozen
class LlamaConfig:
    name: str
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    head_dim: int | None = None  # None: d_model / heads
    seq_len: int = 8192  # default sequence length of a profile
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 puts biases on the Q, K and V projections

    def dims(self) -> dict:
        return {D: self.d_model, L: self.layers, H: self.heads, H_kv: self.kv_heads,
                d_h: self.head_dim or self.d_model // self.heads, F: self.d_ff, V: self.vocab,
                S: self.seq_len, B: 1}


# arXiv:2407.21783 (The Llama 3 Herd of Models), Table 3.
LLAMA3_8B = LlamaConfig("llama3-8b", d_model=4096, layers=32, heads=32, kv_heads=8,
                        d_ff=14336, vocab=128256)
# Same paper, Table 3; the vocabulary (128256) as in the 8B. 405,853,388,800 parameters.
LLAMA3_1_405B = LlamaConfig("llama3.1-405b", d_model=16384, layers=126, heads=128, kv_heads=8,
                            d_ff=53248, vocab=128256)


def build(config: LlamaConfig) -> Graph:
    """The forward graph of one training step: `build(LLAMA3_8B)`."""
    g = GraphBuilder(config.name, config.dims())
    tokens = g.input("tokens", (B, S))
    targets = g.input("targets", (B, S))
    embed = g.weight("embed.weight", (V, D))
    x = g.embedding(tokens, embed, name="embed")
    with g.repeat(L, "layers"):
        x = _block(g, x, config)
    x = g.rmsnorm(x, g.weight("final_norm.weight", (D,)), name="final_norm")
    if config.tie_embeddings:
        logits = g.matmul(x, embed, name="lm_head", category="output_head", transpose_b=True)
    else:
        logits = g.matmul(x, g.weight("lm_head.weight", (D, V)), name="lm_head",
                          category="output_head")
    g.cross_entropy(logits, targets, name="loss")
    graph = g.build()
    graph.meta["seq_len"] = config.seq_len
    return graph


def _block(g: GraphBuilder, x, config: LlamaConfig):
    """One decoder layer: pre-norm grouped-query attention, then a pre-norm SwiGLU MLP."""
    h = g.rmsnorm(x, g.weight("attn_norm.weight", (D,)), name="attn_norm")

    def proj(name, width):
        bias = g.weight(f"{name}.bias", (width,)) if config.qkv_bias else None
        return g.matmul(h, g.weight(f"{name}.weight", (D, width)), bias, name=name)

    q = g.rope(proj("q_proj", H * d_h), name="q_rope")
    k = g.rope(proj("k_proj", H_kv * d_h), name="k_rope")
    v = proj("v_proj", H_kv * d_h)
    o = g.attention(q, k, v, heads=H, kv_heads=H_kv, causal=True, name="attn")
    o = g.matmul(o, g.weight("o_proj.weight", (H * d_h, D)), name="o_proj")
    x = g.add(x, o, name="attn_residual")
    h = g.rmsnorm(x, g.weight("mlp_norm.weight", (D,)), name="mlp_norm")
    gate = g.matmul(h, g.weight("gate_proj.weight", (D, F)), name="gate_proj")
    up = g.matmul(h, g.weight("up_proj.weight", (D, F)), name="up_proj")
    a = g.swiglu(gate, up, name="swiglu")
    down = g.matmul(a, g.weight("down_proj.weight", (F, D)), name="down_proj")
    return g.add(x, down, name="mlp_residual")
