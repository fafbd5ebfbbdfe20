"""DeepSeek-V2 as an op graph: multi-head latent attention (MLA) and DeepSeekMoE.

Attention (arXiv:2405.04434, "DeepSeek-V2", section 2.1; HF `DeepseekV2Attention`): keys and
values come from one compressed latent per token. Per layer: RMSNorm; the query projection (or,
with `q_lora_rank`, a low-rank pair with an RMSNorm between), read as heads of `d_nope + d_rope`
and split into the part without RoPE and the part with it; the K/V down-projection to
`r_kv + d_rope` split into the latent (RMSNorm'd) and one RoPE key shared by every head; the
up-projection of the latent to each head's key part without RoPE and its value (`d_v`); the
shared RoPE key broadcast to every head; each head's query and key parts concatenated; the
attention core (values of another head size than queries and keys); O projection; residual add.

The MLP: the first `first_dense` layers are a dense SwiGLU MLP; every later one DeepSeekMoE,
`shared_experts` always-on experts (one SwiGLU of their summed width) and `routed_experts`
experts of which each token takes the top `experts_per_token`, summed with the shared output.

The views the graph uses are priced by the cost model: reshapes and the broadcast move nothing;
splitting each head's last dimension is strided, so it is charged as a copy; the concatenation
of each head's parts is a copy. Layers are two regions: `dense_layers` and `layers`.
"""

from __future__ import annotations

import attrs
from opgraph.models.llama import moe_mlp, swiglu_mlp

from opgraph.core.builder import GraphBuilder
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, E, F, F_e, H, K, L, S, V, d_nope, d_rope, d_v, dim, r_kv

r_q = dim("r_q")  # the query's low-rank width (q_lora_rank), where there is one


@attrs.frozen
class DeepSeekV2Config:
    name: str
    d_model: int
    layers: int
    heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    d_ff: int  # the dense layers' MLP width (intermediate_size)
    moe_d_ff: int  # one expert's width (moe_intermediate_size)
    shared_experts: int
    routed_experts: int
    experts_per_token: int
    first_dense: int  # first_k_dense_replace
    vocab: int
    q_lora_rank: int | None = None  # None: a full-rank query projection (V2-Lite)
    seq_len: int = 8192
    tie_embeddings: bool = False
    mtp_depth: int = 0  # DeepSeek-V3's multi-token prediction modules (num_nextn_predict_layers)

    def dims(self) -> dict:
        dims = {D: self.d_model, L: self.layers, H: self.heads, r_kv: self.kv_lora_rank,
                d_nope: self.qk_nope_head_dim, d_rope: self.qk_rope_head_dim,
                d_v: self.v_head_dim, F: self.d_ff, F_e: self.moe_d_ff,
                E: self.routed_experts, K: self.experts_per_token, V: self.vocab,
                S: self.seq_len, B: 1}
        return dims | ({r_q: self.q_lora_rank} if self.q_lora_rank else {})


# HF deepseek-ai/DeepSeek-V2-Lite config.json; arXiv:2405.04434 appendix B. Context 163840;
# profiled at 8192 tokens, the plate's.
DEEPSEEK_V2_LITE = DeepSeekV2Config(
    "deepseek-v2-lite", d_model=2048, layers=27, heads=16, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, d_ff=10944, moe_d_ff=1408,
    shared_experts=2, routed_experts=64, experts_per_token=6, first_dense=1, vocab=102400)


def build(config: DeepSeekV2Config) -> Graph:
    """The forward graph of one training step: `build(DEEPSEEK_V2_LITE)`."""
    g = GraphBuilder(config.name, config.dims())
    tokens, targets = g.input("tokens", (B, S)), g.input("targets", (B, S))
    embed = g.weight("embed.weight", (V, D))
    x = g.embedding(tokens, embed, name="embed")
    if config.first_dense:
        with g.repeat(config.first_dense, "dense_layers"):
            x = _block(g, x, config, moe=False)
    if config.layers > config.first_dense:
        with g.repeat(L - config.first_dense, "layers"):
            x = _block(g, x, config, moe=True)
    h = g.rmsnorm(x, g.weight("final_norm.weight", (D,)), name="final_norm")
    head = embed if config.tie_embeddings else g.weight("lm_head.weight", (D, V))
    _logits_loss(g, h, head, targets, config.tie_embeddings, "")
    if config.mtp_depth:
        with g.repeat(config.mtp_depth, "mtp"):
            x = _mtp(g, x, tokens, embed, head, targets, config)
    graph = g.build()
    graph.seq_len = config.seq_len
    return graph


def _logits_loss(g: GraphBuilder, h, head, targets, tied: bool, prefix: str):
    """The output head (`head`: the embedding table when tied) and the cross-entropy loss."""
    logits = g.matmul(h, head, name=f"{prefix}lm_head", category="output_head",
                      **({"transpose_b": True} if tied else {}))
    return g.cross_entropy(logits, targets, name=f"{prefix}loss")


def _mtp(g: GraphBuilder, x, tokens, embed, head, targets, config: DeepSeekV2Config):
    """One multi-token prediction module (DeepSeek-V3, arXiv:2412.19437, section 2.2): the
    previous depth's hidden state (RMSNorm'd) and the embedding of the tokens one further ahead
    (RMSNorm'd, the shared table) concatenated and projected back to D, one Transformer block
    (a DeepSeekMoE layer, as the released checkpoint's `model.layers.61`), and the shared output
    head with its own cross-entropy loss. The shifted tokens cost what the tokens do."""
    e = g.rmsnorm(g.embedding(tokens, embed, name="embed"), g.weight("enorm.weight", (D,)),
                  name="enorm")
    h = g.rmsnorm(x, g.weight("hnorm.weight", (D,)), name="hnorm")
    x = g.matmul(g.concat([e, h], name="concat"), g.weight("eh_proj.weight", (2 * D, D)),
                 name="eh_proj")
    x = _block(g, x, config, moe=True)
    h = g.rmsnorm(x, g.weight("norm.weight", (D,)), name="norm")
    _logits_loss(g, h, head, targets, config.tie_embeddings, "")
    return x


def _block(g: GraphBuilder, x, config: DeepSeekV2Config, moe: bool):
    h = g.rmsnorm(x, g.weight("attn_norm.weight", (D,)), name="attn_norm")
    o = _mla(g, h, config)
    x = g.add(x, g.matmul(o, g.weight("o_proj.weight", (H * d_v, D)), name="o_proj"),
              name="attn_residual")
    h = g.rmsnorm(x, g.weight("mlp_norm.weight", (D,)), name="mlp_norm")
    if moe:
        down = moe_mlp(g, h, F_e)  # the top K of E routed experts, as Mixtral's
        if config.shared_experts:
            shared = swiglu_mlp(g, h, config.shared_experts * F_e, "shared_experts.")
            down = g.add(shared, down, name="experts.sum")
    else:
        down = swiglu_mlp(g, h, F, "mlp.")
    return g.add(x, down, name="mlp_residual")


def _mla(g: GraphBuilder, h, config: DeepSeekV2Config):
    """Multi-head latent attention: `[B, S, D] -> [B, S, H*d_v]`."""
    d_qk = d_nope + d_rope
    if config.q_lora_rank:
        q = g.matmul(h, g.weight("q_a_proj.weight", (D, r_q)), name="q_a_proj")
        q = g.rmsnorm(q, g.weight("q_a_norm.weight", (r_q,)), name="q_a_norm")
        q = g.matmul(q, g.weight("q_b_proj.weight", (r_q, H * d_qk)), name="q_b_proj")
    else:
        q = g.matmul(h, g.weight("q_proj.weight", (D, H * d_qk)), name="q_proj")
    q_nope, q_pe = g.split(g.reshape(q, (B, S, H, d_qk), name="q_heads"), [d_nope, d_rope],
                           name="q_split")
    q_pe = g.rope(q_pe, name="q_rope")
    kv_a = g.matmul(h, g.weight("kv_a_proj.weight", (D, r_kv + d_rope)), name="kv_a_proj")
    latent, k_pe = g.split(kv_a, [r_kv, d_rope], name="kv_split")
    latent = g.rmsnorm(latent, g.weight("kv_a_norm.weight", (r_kv,)), name="kv_a_norm")
    kv = g.matmul(latent, g.weight("kv_b_proj.weight", (r_kv, H * (d_nope + d_v))),
                  name="kv_b_proj")
    k_nope, v = g.split(g.reshape(kv, (B, S, H, d_nope + d_v), name="kv_heads"), [d_nope, d_v],
                        name="kv_b_split")
    k_pe = g.reshape(g.rope(k_pe, name="k_rope"), (B, S, 1, d_rope), name="k_pe_head")
    k_pe = g.broadcast(k_pe, (B, S, H, d_rope), name="k_pe_heads")
    q = g.reshape(g.concat([q_nope, q_pe], name="q_concat"), (B, S, H * d_qk), name="q_flat")
    k = g.reshape(g.concat([k_nope, k_pe], name="k_concat"), (B, S, H * d_qk), name="k_flat")
    v = g.reshape(v, (B, S, H * d_v), name="v_flat")
    return g.attention(q, k, v, heads=H, kv_heads=H, causal=True, name="attn")

