"""GPT-2 (and GPT-3, the same architecture scaled) as an op graph, from its configuration.

One op per kernel of a straightforward implementation: the token and the position embedding
lookups and their sum; per layer LayerNorm (weight and bias); Q, K, V projections with biases
(GPT-2's fused `c_attn` held as three projections: the same FLOPs and parameters); the causal
attention core (multi-head, no RoPE); the output projection with its bias; residual add;
LayerNorm; the MLP (`c_fc` with bias, GELU, `c_proj` with bias); residual add. Then the final
LayerNorm, the output head and the loss.

The output head is tied to the token embedding: it reads the `[V, D]` table transposed, so the
table counts once as a parameter and, read by a matmul, counts for the MFU convention; the
position table is read only by its lookup, so it does not.
"""

from __future__ import annotations

import attrs

from opgraph.builder import GraphBuilder
from opgraph.ir import Graph
from opgraph.symbols import B, D, F, H, L, S, V, d_h, dim

P = dim("P")  # rows of the learned position table (n_positions), the longest sequence


@attrs.frozen
class GPT2Config:
    name: str
    d_model: int
    layers: int
    heads: int
    vocab: int
    positions: int  # n_positions: the position table's rows
    d_ff: int | None = None  # None: 4 x d_model
    seq_len: int | None = None  # default sequence length of a profile; None: `positions`
    tie_embeddings: bool = True

    def dims(self) -> dict:
        return {D: self.d_model, L: self.layers, H: self.heads, d_h: self.d_model // self.heads,
                F: self.d_ff or 4 * self.d_model, V: self.vocab, P: self.positions,
                S: self.seq_len or self.positions, B: 1}


# Radford et al. 2019 (Language Models are Unsupervised Multitask Learners), the 124M model;
# HF openai-community/gpt2 config.json.
GPT2 = GPT2Config("gpt2", d_model=768, layers=12, heads=12, vocab=50257, positions=1024)
# arXiv:2005.14165 (Language Models are Few-Shot Learners), Table 2.1, GPT-3 175B. Its
# alternating locally banded sparse attention layers are profiled as dense causal attention.
GPT3_175B = GPT2Config("gpt3-175b", d_model=12288, layers=96, heads=96, vocab=50257,
                       positions=2048)


def build(config: GPT2Config) -> Graph:
    """The forward graph of one training step: `build(GPT2)`."""
    g = GraphBuilder(config.name, config.dims())
    tokens = g.input("tokens", (B, S))
    positions = g.input("positions", (B, S))
    targets = g.input("targets", (B, S))
    wte = g.weight("wte.weight", (V, D))
    x = g.add(g.embedding(tokens, wte, name="wte"),
              g.embedding(positions, g.weight("wpe.weight", (P, D)), name="wpe"),
              name="embed_sum")
    with g.repeat(L, "layers"):
        x = _block(g, x)
    x = layernorm(g, x, "ln_f")
    g.output_head(x, wte, targets, tied=config.tie_embeddings)
    graph = g.build()
    graph.seq_len = int(config.dims()[S])
    graph.max_seq_len = config.positions
    return graph


def layernorm(g: GraphBuilder, x, name: str):
    return g.layernorm(x, g.weight(f"{name}.weight", (D,)), g.weight(f"{name}.bias", (D,)),
                       name=name)


def linear(g: GraphBuilder, x, name: str, d_in, d_out):
    """`x @ w + b`, one kernel."""
    return g.matmul(x, g.weight(f"{name}.weight", (d_in, d_out)),
                    g.weight(f"{name}.bias", (d_out,)), name=name)


def _block(g: GraphBuilder, x):
    """One decoder layer: pre-norm multi-head attention, then a pre-norm GELU MLP."""
    h = layernorm(g, x, "ln_1")
    q = linear(g, h, "q_proj", D, H * d_h)
    k = linear(g, h, "k_proj", D, H * d_h)
    v = linear(g, h, "v_proj", D, H * d_h)
    o = g.attention(q, k, v, heads=H, kv_heads=H, causal=True, name="attn")
    x = g.add(x, linear(g, o, "o_proj", H * d_h, D), name="attn_residual")
    h = layernorm(g, x, "ln_2")
    a = g.gelu(linear(g, h, "fc", D, F), name="gelu")
    return g.add(x, linear(g, a, "proj", F, D), name="mlp_residual")
