"""gpt-oss as an op graph, from its configuration.

Per layer (OpenAI's gpt-oss model card, arXiv:2508.10925, section 2; HF `GptOssDecoderLayer`):
RMSNorm; grouped-query attention with biases on Q, K, V and O, RoPE on Q and K, the core over a
sliding window of 128 keys in one layer and over the whole sequence in the next (the config's
`layer_types`, sliding first); residual add; RMSNorm; a mixture of experts (a router with a
bias scores the E experts, each token goes through its top K, each expert a gated linear unit
of width F_e with biases on its projections, their outputs summed weighted by the router's
gates); residual add. Around the stack: the embedding lookup, the final RMSNorm, the untied
output head, the loss.

The stack is one region of L / 2 iterations, a sliding-window layer then a full one, as Gemma
2's local and global layers. Costed as a Llama-style mixture of experts, with these
approximations, each a few FLOPs or bytes a token:

- the experts' activation: gpt-oss clamps the gate and up projections and computes
  `(up + 1) * gate * sigmoid(1.702 gate)`; it is costed as SwiGLU's kernel on the same tensors;
- the experts' and the router's biases are not counted (one add an output element, in the
  GEMM's epilogue);
- the attention sinks (a learned logit per head in each softmax's denominator) are not
  counted, nor whether an attention kernel supports them.
"""

from __future__ import annotations

import attrs

from opgraph.core.builder import GraphBuilder
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, E, F_e, H, H_kv, K, L, S, V, W, d_h

from .llama import attention, moe_mlp

SLIDING, FULL = "sliding", "full"  # the two layers of the stack's body, in order


@attrs.frozen
class GptOssConfig:
    name: str
    d_model: int
    layers: int  # even: sliding-window and full layers alternate
    heads: int
    kv_heads: int
    head_dim: int
    experts: int  # num_local_experts
    experts_per_token: int  # num_experts_per_tok
    moe_d_ff: int  # one expert's width (intermediate_size)
    vocab: int
    window: int = 128  # sliding_window
    seq_len: int = 4096  # initial_context_length, the pre-training context
    tie_embeddings: bool = False
    # what `llama.attention` reads: biases on Q, K, V and O, no norm of the heads
    qkv_bias = o_bias = True
    qk_norm = False

    def dims(self) -> dict:
        return {D: self.d_model, L: self.layers, H: self.heads, H_kv: self.kv_heads,
                d_h: self.head_dim, E: self.experts, K: self.experts_per_token,
                F_e: self.moe_d_ff, V: self.vocab, W: self.window, S: self.seq_len, B: 1}


# HF openai/gpt-oss-120b and gpt-oss-20b config.json; the model card's Table 1.
GPT_OSS_120B = GptOssConfig("gpt-oss-120b", d_model=2880, layers=36, heads=64, kv_heads=8,
                            head_dim=64, experts=128, experts_per_token=4, moe_d_ff=2880,
                            vocab=201088)
GPT_OSS_20B = attrs.evolve(GPT_OSS_120B, name="gpt-oss-20b", layers=24, experts=32)


def build(config: GptOssConfig) -> Graph:
    """The forward graph of one training step: `build(GPT_OSS_120B)`."""
    if config.layers % 2:
        raise OpgraphError(f"{config.name}: {config.layers} layers; gpt-oss alternates "
                           "sliding-window and full layers, so it needs an even count")
    g = GraphBuilder(config.name, config.dims())
    tokens, targets = g.input("tokens", (B, S)), g.input("targets", (B, S))
    embed = g.weight("embed.weight", (V, D))
    x = g.embedding(tokens, embed, name="embed")
    with g.repeat(L / 2, "layers"):
        x = _layer(g, x, config, SLIDING, window=W)
        x = _layer(g, x, config, FULL, window=None)
    x = g.rmsnorm(x, g.weight("final_norm.weight", (D,)), name="final_norm")
    g.output_head(x, embed, targets, tied=config.tie_embeddings)
    graph = g.build()
    graph.seq_len = config.seq_len
    return graph


def _layer(g: GraphBuilder, x, config: GptOssConfig, kind: str, window):
    prefix = f"{kind}."
    h = g.rmsnorm(x, g.weight(f"{prefix}attn_norm.weight", (D,)), name=f"{prefix}attn_norm")
    x = g.add(x, attention(g, h, config, prefix, window), name=f"{prefix}attn_residual")
    h = g.rmsnorm(x, g.weight(f"{prefix}mlp_norm.weight", (D,)), name=f"{prefix}mlp_norm")
    return g.add(x, moe_mlp(g, h, F_e, prefix), name=f"{prefix}mlp_residual")
