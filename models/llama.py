"""Llama 3 (and its relatives) as an op graph, from its configuration.

One op per kernel of a straightforward implementation (PLATE.md): per layer RMSNorm; Q, K, V
projections; RoPE on Q and K; the attention core (scores, then P.V); O projection; residual add;
RMSNorm; gate and up projections; SwiGLU; down projection; residual add. Around the stack: the
embedding lookup, the final RMSNorm, the output head and the cross-entropy loss.

Its relatives are configurations of the same graph: Llama 3 70B; Qwen2 (biases on Q, K and V);
Qwen3 (each query and key head RMSNorm'd before RoPE, `qk_norm`); Mistral (through
`models.hf`); Mixtral, whose MLP is a mixture of experts (`moe_mlp`: a router, the top K of E
SwiGLU experts per token, their gate-weighted sum).

The graph's shapes are symbols (`opgraph.core.symbols`); the configuration supplies their values.
"""

from __future__ import annotations

import attrs

from opgraph.core.builder import GraphBuilder
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, E, F, H, H_kv, K, L, S, V, W, d_h


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
    o_bias: bool = False  # a bias on the O projection too (HF Llama's attention_bias)
    mlp_bias: bool = False  # biases on the gate, up and down projections (HF's mlp_bias)
    qk_norm: bool = False  # an RMSNorm on each query and key head before RoPE (Qwen3)
    experts: int = 0  # a mixture of this many SwiGLU experts per MLP (Mixtral); 0: dense
    experts_per_token: int = 0  # the top-k each token is routed to
    window: int | None = None  # every layer attends over its last W keys (Mistral 7B v0.1)

    def dims(self) -> dict:
        dims = {D: self.d_model, L: self.layers, H: self.heads, H_kv: self.kv_heads,
                d_h: self.head_dim or self.d_model // self.heads, F: self.d_ff, V: self.vocab,
                S: self.seq_len, B: 1}
        if self.experts:
            dims |= {E: self.experts, K: self.experts_per_token}
        if self.window:
            dims[W] = self.window
        return dims


# arXiv:2407.21783 (The Llama 3 Herd of Models), Table 3.
LLAMA3_8B = LlamaConfig("llama3-8b", d_model=4096, layers=32, heads=32, kv_heads=8,
                        d_ff=14336, vocab=128256)
LLAMA3_70B = LlamaConfig("llama3-70b", d_model=8192, layers=80, heads=64, kv_heads=8,
                         d_ff=28672, vocab=128256)
# Same paper, Table 3; the vocabulary (128256) as in the 8B. 405,853,388,800 parameters.
LLAMA3_1_405B = LlamaConfig("llama3.1-405b", d_model=16384, layers=126, heads=128, kv_heads=8,
                            d_ff=53248, vocab=128256)
# HF meta-llama/Llama-3.2-1B config.json: tied embeddings, head size 64. 1,235,814,400
# parameters. Context 131072; profiled at 8192.
LLAMA3_2_1B = LlamaConfig("llama3.2-1b", d_model=2048, layers=16, heads=32, kv_heads=8,
                          d_ff=8192, vocab=128256, head_dim=64, tie_embeddings=True)
# arXiv:2401.04088 (Mixtral of Experts), Table 1; HF mistralai/Mixtral-8x7B-v0.1 config.json.
# Context 32768; profiled at 8192 tokens by default, like the plate.
MIXTRAL_8X7B = LlamaConfig("mixtral-8x7b", d_model=4096, layers=32, heads=32, kv_heads=8,
                           d_ff=14336, vocab=32000, experts=8, experts_per_token=2)
# arXiv:2407.10671 (Qwen2 Technical Report), Table 1; HF Qwen/Qwen2-7B config.json, whose
# embedding has 152064 rows (the tokenizer's 151646, padded). Context 131072; profiled at 8192.
QWEN2_7B = LlamaConfig("qwen2-7b", d_model=3584, layers=28, heads=28, kv_heads=4, d_ff=18944,
                       vocab=152064, qkv_bias=True)


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
    g.output_head(x, embed, targets, tied=config.tie_embeddings)
    graph = g.build()
    graph.seq_len = config.seq_len
    return graph


def _block(g: GraphBuilder, x, config: LlamaConfig):
    """One decoder layer: pre-norm grouped-query attention, then a pre-norm SwiGLU MLP."""
    h = g.rmsnorm(x, g.weight("attn_norm.weight", (D,)), name="attn_norm")
    x = g.add(x, attention(g, h, config, window=W if config.window else None),
              name="attn_residual")
    h = g.rmsnorm(x, g.weight("mlp_norm.weight", (D,)), name="mlp_norm")
    down = moe_mlp(g, h) if config.experts else swiglu_mlp(g, h, bias=config.mlp_bias)
    return g.add(x, down, name="mlp_residual")


def attention(g: GraphBuilder, h, config, prefix: str = "", window=None):
    """Grouped-query attention of the normed input `h`, up to its O projection: Q, K and V
    projections (biases on Q, K, V with `config.qkv_bias`, on O with `config.o_bias`); with
    `config.qk_norm` each query and key head RMSNorm'd over its `d_h` (Qwen3's `q_norm`,
    `k_norm`), before RoPE on Q and K (none where `config.rope` is False); the core, over the last `window` keys where one is given
    (a dimension symbol, `W`). `prefix` names a layer among several in one region's body."""
    def proj(name, width):
        bias = g.weight(f"{prefix}{name}.bias", (width,)) if config.qkv_bias else None
        return g.matmul(h, g.weight(f"{prefix}{name}.weight", (D, width)), bias,
                        name=f"{prefix}{name}")

    def head_norm(t, heads, name):
        """RMSNorm of each head over its d_h: the heads are a view, the norm one kernel."""
        t = g.reshape(t, (B, S, heads, d_h), name=f"{prefix}{name}.heads")
        t = g.rmsnorm(t, g.weight(f"{prefix}{name}.weight", (d_h,)), name=f"{prefix}{name}")
        return g.reshape(t, (B, S, heads * d_h), name=f"{prefix}{name}.flat")

    rope = getattr(config, "rope", True)  # Nemotron-H's attention has no position encoding
    q = proj("q_proj", H * d_h)
    if config.qk_norm:
        q = head_norm(q, H, "q_norm")
    if rope:
        q = g.rope(q, name=f"{prefix}q_rope")
    k = proj("k_proj", H_kv * d_h)
    if config.qk_norm:
        k = head_norm(k, H_kv, "k_norm")
    if rope:
        k = g.rope(k, name=f"{prefix}k_rope")
    v = proj("v_proj", H_kv * d_h)
    o = g.attention(q, k, v, heads=H, kv_heads=H_kv, causal=True, window=window,
                    name=f"{prefix}attn")
    o_bias = g.weight(f"{prefix}o_proj.bias", (D,)) if config.o_bias else None
    return g.matmul(o, g.weight(f"{prefix}o_proj.weight", (H * d_h, D)), o_bias,
                    name=f"{prefix}o_proj")


def swiglu_mlp(g: GraphBuilder, h, width=F, prefix: str = "", bias: bool = False):
    """`down(silu(gate(h)) * up(h))` of hidden width `width`, its ops and weights named under
    `prefix` (Llama's MLP: none; `mlp.`, `shared_experts.`: DeepSeek's dense layers and shared
    experts, Qwen-MoE's); `bias` puts a bias on each projection (HF Llama's `mlp_bias`)."""
    def proj(x, name, shape):
        b = g.weight(f"{prefix}{name}.bias", shape[-1:]) if bias else None
        return g.matmul(x, g.weight(f"{prefix}{name}.weight", shape), b, name=f"{prefix}{name}")

    a = g.swiglu(proj(h, "gate_proj", (D, width)), proj(h, "up_proj", (D, width)),
                 name=f"{prefix}swiglu")
    return proj(a, "down_proj", (width, D))


def moe_mlp(g: GraphBuilder, h, width=F, prefix: str = ""):
    """Mixtral's sparse MLP: a router scores the E experts, each token is copied to its top K
    experts' slots and goes through those SwiGLU experts, and their outputs are summed weighted
    by the router's gates. Expert weights are held as `[E, in, out]` tensors; only the routed
    experts' FLOPs are counted. `width` is an expert's hidden width (Mixtral's F; DeepSeek's
    and Qwen's narrower experts, F_e); `prefix` names a layer among several in one region's
    body."""
    logits = g.matmul(h, g.weight(f"{prefix}router.weight", (D, E)), name=f"{prefix}router")
    gates, experts = g.topk(logits, K, name=f"{prefix}router_topk")

    def expert(x, name, shape):
        return g.expert_matmul(x, g.weight(f"{prefix}experts.{name}.weight", shape), experts,
                               name=f"{prefix}experts.{name}")

    # the dispatcher's copy of each token to its K experts' slots (Megatron-Core's `permute`,
    # megatron/core/transformer/moe/moe_utils.py), which the expert GEMMs read and keep
    slots = g.moe_permute(h, experts, name=f"{prefix}experts.permute")
    gate = expert(slots, "gate_proj", (E, D, width))
    up = expert(slots, "up_proj", (E, D, width))
    a = g.swiglu(gate, up, name=f"{prefix}experts.swiglu")
    down = expert(a, "down_proj", (E, width, D))
    return g.moe_combine(down, gates, name=f"{prefix}experts.combine")
