"""BERT (BertForMaskedLM) as an op graph, from its configuration.

arXiv:1810.04805 ("BERT"); HF `BertForMaskedLM`. The embeddings: token, position and token-type
lookups summed, then LayerNorm. Per layer, post-LN: Q, K, V projections with biases; the
bidirectional (not causal) attention core; the output projection with its bias; residual add;
LayerNorm; the MLP (with biases, exact GELU); residual add; LayerNorm. The masked-LM head runs on
the masked positions only (`M` per sequence, gathered from the last layer's output, as the
original pre-training code does): a dense transform with its bias, exact GELU, LayerNorm, then
the decoder tied to the token embedding with its own bias, and the loss.
"""

from __future__ import annotations

import attrs
from opgraph.models.gpt2 import layernorm, linear

from opgraph.core.builder import GraphBuilder
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, F, H, L, M, S, V, d_h, dim

P = dim("P")  # rows of the learned position table (max_position_embeddings)
T = dim("T")  # token types (type_vocab_size)


@attrs.frozen
class BertConfig:
    name: str
    d_model: int
    layers: int
    heads: int
    d_ff: int
    vocab: int
    positions: int = 512
    token_types: int = 2
    seq_len: int = 512
    masked: int | None = None  # positions predicted per sequence; None: 5/32 of seq_len
    gelu: str = "none"  # exact GELU ("gelu"); "tanh" for the approximation ("gelu_new")

    def dims(self) -> dict:
        return {D: self.d_model, L: self.layers, H: self.heads, d_h: self.d_model // self.heads,
                F: self.d_ff, V: self.vocab, P: self.positions, T: self.token_types,
                S: self.seq_len, M: self.masked or max(1, self.seq_len * 5 // 32), B: 1}


# HF google-bert/bert-base-uncased config.json; arXiv:1810.04805 section 3 (BERT_BASE: L=12,
# H=768, A=12). Pre-training predicts at most 20 masked positions per sequence of 128 tokens and
# 80 of 512 (google-research/bert's README, max_predictions_per_seq): 5/32 of the sequence.
BERT_BASE = BertConfig("bert-base", d_model=768, layers=12, heads=12, d_ff=3072, vocab=30522)


def build(config: BertConfig) -> Graph:
    """The forward graph of one training step: `build(BERT_BASE)`."""
    g = GraphBuilder(config.name, config.dims())
    tokens, positions = g.input("tokens", (B, S)), g.input("positions", (B, S))
    token_types = g.input("token_types", (B, S))
    masked, targets = g.input("masked_positions", (B, M)), g.input("targets", (B, M))
    table = g.weight("word_embeddings.weight", (V, D))
    x = g.add(g.embedding(tokens, table, name="word_embeddings"),
              g.embedding(positions, g.weight("position_embeddings.weight", (P, D)),
                          name="position_embeddings"), name="embed_sum")
    x = g.add(x, g.embedding(token_types, g.weight("token_type_embeddings.weight", (T, D)),
                             name="token_type_embeddings"), name="embed_types")
    x = layernorm(g, x, "embed_norm")
    with g.repeat(L, "layers"):
        x = _block(g, x, config.gelu)
    h = g.gather(x, masked, name="masked")
    h = layernorm(g, g.gelu(linear(g, h, "transform", D, D), approximate=config.gelu,
                             name="transform_gelu"), "transform_norm")
    g.output_head(h, table, targets, tied=True, bias=True)
    graph = g.build()
    graph.seq_len = config.seq_len
    graph.max_seq_len = config.positions
    return graph


def _block(g: GraphBuilder, x, gelu: str):
    """One encoder layer, post-LN: the norm after each residual add."""
    q = linear(g, x, "q_proj", D, H * d_h)
    k = linear(g, x, "k_proj", D, H * d_h)
    v = linear(g, x, "v_proj", D, H * d_h)
    o = g.attention(q, k, v, heads=H, kv_heads=H, causal=False, name="attn")
    x = layernorm(g, g.add(x, linear(g, o, "o_proj", H * d_h, D), name="attn_residual"),
                   "attn_norm")
    a = g.gelu(linear(g, x, "fc", D, F), approximate=gelu, name="gelu")
    return layernorm(g, g.add(x, linear(g, a, "proj", F, D), name="mlp_residual"), "mlp_norm")
