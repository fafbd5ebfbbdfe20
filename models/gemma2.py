"""Gemma 2 as an op graph, from its configuration.

Per layer (arXiv:2408.00118, "Gemma 2: Improving Open Language Models at a Practical Size";
HF `Gemma2DecoderLayer`): RMSNorm; Q, K, V projections (grouped-query, head size 256 whatever
d_model); RoPE on Q and K; the attention core with its logits soft-capped (50), over a sliding
window of 4096 keys in even layers and over the whole sequence in odd ones; O projection;
RMSNorm of the attention's output (a norm before *and* after each sublayer); residual add;
RMSNorm; gate and up projections; GeGLU (tanh GELU); down projection; RMSNorm; residual add.
Around the stack: the embedding lookup scaled by sqrt(d_model), the final RMSNorm, the output
head tied to the embedding, the final logits soft-capped (30), the loss.

The stack is one region of L / 2 iterations, each a local (windowed) layer then a global one.
"""

from __future__ import annotations

import math

import attrs

from opgraph.core.builder import GraphBuilder
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, F, H, H_kv, L, S, V, W, d_h


@attrs.frozen
class Gemma2Config:
    name: str
    d_model: int
    layers: int  # even: local and global layers alternate
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    window: int = 4096  # sliding_window of the local layers
    attn_softcap: float | None = 50.0  # attn_logit_softcapping
    final_softcap: float | None = 30.0  # final_logit_softcapping
    seq_len: int = 8192
    tie_embeddings: bool = True

    def dims(self) -> dict:
        return {D: self.d_model, L: self.layers, H: self.heads, H_kv: self.kv_heads,
                d_h: self.head_dim, F: self.d_ff, V: self.vocab, W: self.window,
                S: self.seq_len, B: 1}


# HF google/gemma-2-2b config.json; arXiv:2408.00118 Table 1. Context 8192.
GEMMA2_2B = Gemma2Config("gemma2-2b", d_model=2304, layers=26, heads=8, kv_heads=4,
                         head_dim=256, d_ff=9216, vocab=256000)


def build(config: Gemma2Config) -> Graph:
    """The forward graph of one training step: `build(GEMMA2_2B)`."""
    if config.layers % 2:
        raise OpgraphError(f"{config.name}: {config.layers} layers; Gemma 2 alternates local "
                           "and global layers, so it needs an even count")
    g = GraphBuilder(config.name, config.dims())
    tokens, targets = g.input("tokens", (B, S)), g.input("targets", (B, S))
    embed = g.weight("embed.weight", (V, D))
    x = g.scale(g.embedding(tokens, embed, name="embed"), math.sqrt(config.d_model),
                name="embed_scale")
    with g.repeat(L / 2, "layers"):
        x = _block(g, x, config, "local", window=W)
        x = _block(g, x, config, "global", window=None)
    x = g.rmsnorm(x, g.weight("final_norm.weight", (D,)), name="final_norm")
    head = embed if config.tie_embeddings else g.weight("lm_head.weight", (V, D))
    logits = g.matmul(x, head, name="lm_head", category="output_head", transpose_b=True)
    if config.final_softcap is not None:
        logits = g.op("softcap", [logits], category="output_head", name="final_softcap",
                      cap=config.final_softcap)
    g.cross_entropy(logits, targets, name="loss")
    graph = g.build()
    graph.seq_len = config.seq_len
    return graph


def _block(g: GraphBuilder, x, config: Gemma2Config, kind: str, window):
    """One layer: norms before and after attention and after the MLP, GeGLU."""
    def norm(t, name):
        return g.rmsnorm(t, g.weight(f"{kind}.{name}.weight", (D,)), name=f"{kind}.{name}")

    def proj(t, name, d_in, d_out):
        return g.matmul(t, g.weight(f"{kind}.{name}.weight", (d_in, d_out)),
                        name=f"{kind}.{name}")

    h = norm(x, "input_norm")
    q = g.rope(proj(h, "q_proj", D, H * d_h), name=f"{kind}.q_rope")
    k = g.rope(proj(h, "k_proj", D, H_kv * d_h), name=f"{kind}.k_rope")
    v = proj(h, "v_proj", D, H_kv * d_h)
    o = g.attention(q, k, v, heads=H, kv_heads=H_kv, causal=True, window=window,
                    softcap=config.attn_softcap, name=f"{kind}.attn")
    o = norm(proj(o, "o_proj", H * d_h, D), "post_attn_norm")
    x = g.add(x, o, name=f"{kind}.attn_residual")
    h = norm(x, "pre_mlp_norm")
    a = g.geglu(proj(h, "gate_proj", D, F), proj(h, "up_proj", D, F), name=f"{kind}.geglu")
    down = norm(proj(a, "down_proj", F, D), "post_mlp_norm")
    return g.add(x, down, name=f"{kind}.mlp_residual")
