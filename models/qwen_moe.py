"""Qwen2-MoE and Qwen3-MoE as an op graph, from their configuration.

Per layer (HF `Qwen2MoeDecoderLayer`, `Qwen3MoeDecoderLayer`): RMSNorm; grouped-query attention
as Llama's (`llama.attention`: Qwen2-MoE with biases on Q, K and V; Qwen3-MoE with each query and
key head RMSNorm'd before RoPE); residual add; RMSNorm; the MLP; residual add.

The MLP of a sparse layer (`Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`) is Mixtral's
(`llama.moe_mlp`: a router, the top K of E SwiGLU experts of width F_e, their gate-weighted sum);
Qwen2-MoE adds one shared SwiGLU expert of width F_s whose output is scaled by
`sigmoid(shared_expert_gate(h))`, a Linear D -> 1, and summed with the routed experts'. That
scaling is a one-slot `moe_combine` (the shared output and its one gate per token in, the
product out: the bytes of the kernel; its FLOPs count 2 per element where the product needs 1,
which covers the sigmoid of one number per token, not a kernel of its own here). A dense layer
is a SwiGLU MLP of width F (`intermediate_size`).

Llama 4's text model is the same graph (`models.hf`, `model_type` llama4): a router over E
SwiGLU experts, top 1, and a shared expert without a gate, in every layer (Scout) or every
second (Maverick, `interleave_moe_layer_step`, the others dense MLPs of
`intermediate_size_mlp`); each query and key head normed (`use_qk_norm`, an L2 norm costed as
RMSNorm's kernel). Its chunked attention (`attention_chunk_size`, 8,192 keys, in three layers of
four) is the causal attention over the whole sequence up to that length, which is how it is
costed; its global layers without RoPE are costed with it.

Which layers are sparse follows transformers: layer i (from 0) is a mixture of experts iff there
are experts, i is not in `dense_layers` (`mlp_only_layers`) and (i + 1) is a multiple of
`sparse_step` (`decoder_sparse_step`). `stacks` lays the layers out as regions: with a step of
1, one region of sparse layers (`layers`); with a step s > 1, one region whose body is s - 1
dense layers then a sparse one (`dense.`, `moe.`, as Gemma 2's local and global layers), and
the L mod s dense layers left over as a region of their own (`last_dense_layers`); layers
`mlp_only_layers` makes dense at the start (`dense_layers`) or the end join those. Dense layers
between sparse ones (an index of `mlp_only_layers` in the middle) are an error: the graph would
need a region per run of layers.
"""

from __future__ import annotations

import attrs
import sympy
from opgraph.models.llama import attention, moe_mlp, swiglu_mlp

from opgraph.core.builder import GraphBuilder
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, E, F, F_e, F_s, H, H_kv, K, L, S, V, d_h

DENSE, SPARSE = "dense", "moe"
MAX_SPARSE_STEP = 64  # a region's body holds decoder_sparse_step layers; real models use 1 or 2


@attrs.frozen
class QwenMoeConfig:
    name: str
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int  # num_experts; 0: every layer dense
    experts_per_token: int  # num_experts_per_tok
    moe_d_ff: int  # one routed expert's width (moe_intermediate_size)
    d_ff: int | None = None  # a dense layer's width (intermediate_size); None: no dense layer
    shared_d_ff: int | None = None  # the shared expert's width (Qwen2-MoE); None: none
    sparse_step: int = 1  # decoder_sparse_step
    dense_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # mlp_only_layers
    head_dim: int | None = None  # None: d_model / heads
    qkv_bias: bool = False  # Qwen2-MoE's biases on Q, K and V
    o_bias: bool = False  # a bias on O too (Qwen3-MoE's attention_bias, with Q, K and V's)
    qk_norm: bool = False  # Qwen3-MoE's RMSNorm of each query and key head
    shared_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert (Llama 4: none)
    seq_len: int = 8192
    tie_embeddings: bool = False

    def dims(self) -> dict:
        dims = {D: self.d_model, L: self.layers, H: self.heads, H_kv: self.kv_heads,
                d_h: self.head_dim or self.d_model // self.heads, V: self.vocab,
                S: self.seq_len, B: 1}
        if self.d_ff:
            dims[F] = self.d_ff
        if self.experts:
            dims |= {E: self.experts, K: self.experts_per_token, F_e: self.moe_d_ff}
        if self.experts and self.shared_d_ff:
            dims[F_s] = self.shared_d_ff
        return dims


@attrs.frozen
class Stack:
    """A run of layers built as one region `name`: `body` (each DENSE or SPARSE) `count` times."""

    name: str
    count: sympy.Expr | int
    body: tuple[str, ...]


def stacks(config: QwenMoeConfig, where: str | None = None) -> tuple[Stack, ...]:
    """The layer stacks, in order: `stacks(QWEN3_30B_A3B)` is one `layers` stack of L sparse
    layers. A layout of dense layers between sparse ones raises OpgraphError, naming `where`
    (default the model's name)."""
    where = where or config.name
    layers, step = config.layers, config.sparse_step
    if config.experts and MAX_SPARSE_STEP < step <= layers:
        raise OpgraphError(f"{where}: decoder_sparse_step = {step}; opgraph builds a stack whose "
                           f"body is that many layers, and reads steps up to {MAX_SPARSE_STEP}")
    periods, rest = divmod(layers, step)  # period p's last layer, p*step + step - 1, is sparse
    if not config.experts or not periods:
        return (Stack("dense_layers", L, (DENSE,)),)
    # transformers ignores indices past the last layer: they match no layer
    forced = {i // step for i in config.dense_layers if i < layers and (i + 1) % step == 0}
    first = 0  # periods made dense at the start, then at the end
    while first in forced:
        first += 1
    last = 0
    while periods - 1 - last in forced and periods - 1 - last >= first:
        last += 1
    if first + last < len(forced):
        middle = min(p for p in forced if first <= p < periods - last)
        raise OpgraphError(f"{where}: mlp_only_layers makes layer {middle * step + step - 1} "
                           "dense between mixture-of-experts layers; opgraph builds dense layers "
                           "only at the start or the end of the stack (the layers of "
                           "mlp_only_layers together at one end, or both)")
    if first + last == periods:
        return (Stack("dense_layers", L, (DENSE,)),)
    lead, trail = first * step, last * step + rest
    out = [Stack("dense_layers", lead, (DENSE,))] if lead else []
    out.append(Stack("layers", (L - lead - trail) / step, (DENSE,) * (step - 1) + (SPARSE,)))
    if trail:
        out.append(Stack("last_dense_layers", trail, (DENSE,)))
    return tuple(out)


# HF Qwen/Qwen1.5-MoE-A2.7B config.json: 24 layers, all sparse (decoder_sparse_step 1), 60
# experts of 1408 of which 4 per token, one shared expert of 5632; 14.3 B parameters, 2.7 B
# active (its model card). Context 8192.
QWEN1_5_MOE_A2_7B = QwenMoeConfig(
    "qwen1.5-moe-a2.7b", d_model=2048, layers=24, heads=16, kv_heads=16, vocab=151936,
    experts=60, experts_per_token=4, moe_d_ff=1408, shared_d_ff=5632, qkv_bias=True)
# HF Qwen/Qwen3-30B-A3B config.json: 48 layers, all sparse, 128 experts of 768 of which 8 per
# token, head size 128 (not 2048 / 32); 30.5 B parameters, 3.3 B active (its model card).
# Context 40960; profiled at 8192.
QWEN3_30B_A3B = QwenMoeConfig(
    "qwen3-30b-a3b", d_model=2048, layers=48, heads=32, kv_heads=4, vocab=151936, experts=128,
    experts_per_token=8, moe_d_ff=768, head_dim=128, qk_norm=True)


def build(config: QwenMoeConfig) -> Graph:
    """The forward graph of one training step: `build(QWEN3_30B_A3B)`."""
    layout = stacks(config)
    g = GraphBuilder(config.name, config.dims())
    tokens, targets = g.input("tokens", (B, S)), g.input("targets", (B, S))
    embed = g.weight("embed.weight", (V, D))
    x = g.embedding(tokens, embed, name="embed")
    for stack in layout:
        with g.repeat(stack.count, stack.name):
            for i, kind in enumerate(stack.body):
                x = _layer(g, x, config, kind, _prefix(stack.body, i))
    x = g.rmsnorm(x, g.weight("final_norm.weight", (D,)), name="final_norm")
    g.output_head(x, embed, targets, tied=config.tie_embeddings)
    graph = g.build()
    graph.seq_len = config.seq_len
    return graph


def _prefix(body: tuple[str, ...], i: int) -> str:
    """A layer's name in a body of several: `dense.`, `moe.` (`dense0.`, `dense1.`, ... when
    the body holds several dense layers); none in a body of one."""
    if len(body) == 1:
        return ""
    return f"{body[i]}{i if body.count(body[i]) > 1 else ''}."


def _layer(g: GraphBuilder, x, config: QwenMoeConfig, kind: str, prefix: str):
    h = g.rmsnorm(x, g.weight(f"{prefix}attn_norm.weight", (D,)), name=f"{prefix}attn_norm")
    x = g.add(x, attention(g, h, config, prefix), name=f"{prefix}attn_residual")
    h = g.rmsnorm(x, g.weight(f"{prefix}mlp_norm.weight", (D,)), name=f"{prefix}mlp_norm")
    if kind == DENSE:
        down = swiglu_mlp(g, h, F, f"{prefix}mlp.")
    else:
        down = moe_mlp(g, h, F_e, prefix)
        if config.shared_d_ff:
            shared = (_gated_shared_expert(g, h, prefix) if config.shared_gate
                      else swiglu_mlp(g, h, F_s, f"{prefix}shared_expert."))
            down = g.add(down, shared, name=f"{prefix}experts.sum")
    return g.add(x, down, name=f"{prefix}mlp_residual")


def _gated_shared_expert(g: GraphBuilder, h, prefix: str):
    """`sigmoid(shared_expert_gate(h)) * shared_expert(h)`, the product as a one-slot combine."""
    shared = swiglu_mlp(g, h, F_s, f"{prefix}shared_expert.")
    gate = g.matmul(h, g.weight(f"{prefix}shared_expert_gate.weight", (D, 1)),
                    name=f"{prefix}shared_expert_gate")
    slot = g.reshape(shared, (B, S, 1, D), name=f"{prefix}shared_expert.slot")
    return g.moe_combine(slot, gate, name=f"{prefix}shared_expert.gated")
