"""Nemotron-H and Nemotron 3 as an op graph: a hybrid of Mamba-2, attention and MLP or
mixture-of-experts layers, from its configuration.

The layers follow a pattern string (Megatron-Core's `hybrid_layer_pattern`, HF's
`hybrid_override_pattern`), one character a layer, each a pre-norm residual block (RMSNorm, the
mixer, the residual add):

- `M`, Mamba-2 (Dao and Gu 2024, arXiv:2405.21060; Megatron-Core's `MambaMixer` with its fused
  path, `mamba_split_conv1d_scan_combined`): `in_proj` to z, xBC and dt (2 H_m d_m + 2 G_m N_m +
  H_m wide), the causal depthwise convolution over xBC (width k_m, with bias and SiLU), the SSD
  scan over x, dt, B and C (`opgraph.core.rules.ssm`: the chunk states, then the chunk scan with
  the skip D), the gate y * silu(z), an RMSNorm over each of the G_m groups, `out_proj`;
- `*`, grouped-query attention with no position encoding (Megatron's `position_embedding_type`
  "none"; `models.llama.attention` without RoPE);
- `-`, an MLP of ReLU squared (`relu2`): up, activation, down, no gate;
- `E`, a mixture of experts: a router (sigmoid scores with a bias; costed as a router's matmul
  and top-k), each token through its top K of E experts, each a ReLU-squared MLP of width F_e,
  and a shared expert of width F_s beside them.

Around the stack: the embedding, the final RMSNorm, the output head (untied) and the loss.

The graph keeps one region per layer kind, its trip count the number of such layers in the
pattern, run in the order M, *, -, E: every layer of a kind costs the same wherever it sits, so
one profile's times, FLOPs, memory and collectives are the pattern's. Pipeline parallelism needs
the pattern's order to cut it into stages and is an error (`passes.split_stages`: more than one
stack); context parallelism runs the Mamba layers as Megatron-Core does (`passes.shard`). Left
out: the gate and the group norm are two kernels here and one in `mamba_ssm`
(`_layer_norm_fwd` with z); the fused path's backward re-running the convolution rather than
keeping its output; Megatron's `first_last_layers_bf16` (the first and last layers outside FP8);
the router's expert bias (E adds per token).
"""

from __future__ import annotations

import attrs

from opgraph.core.builder import GraphBuilder
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import FP32, Graph
from opgraph.core.symbols import (
    B,
    D,
    E,
    F,
    F_e,
    F_s,
    G_m,
    H,
    H_kv,
    H_m,
    K,
    L,
    N_m,
    Q_m,
    S,
    V,
    d_h,
    d_m,
    k_m,
)

from .llama import attention

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
# each layer kind's region, in the order the graph runs them
REGIONS = {MAMBA: "mamba_layers", ATTENTION: "attention_layers", MLP: "mlp_layers",
           MOE: "moe_layers"}


@attrs.frozen
class NemotronHConfig:
    name: str
    d_model: int
    pattern: str  # one character a layer: M, *, -, E
    heads: int
    kv_heads: int
    head_dim: int
    mamba_heads: int
    mamba_head_dim: int
    state: int  # N, ssm_state_size
    groups: int  # n_groups: the heads sharing one B and C
    vocab: int
    d_ff: int = 0  # a `-` layer's width
    experts: int = 0  # an `E` layer's routed experts
    experts_per_token: int = 0
    moe_d_ff: int = 0  # one routed expert's width
    shared_d_ff: int = 0  # the shared expert's width (0: none)
    conv_width: int = 4  # conv_kernel (d_conv)
    chunk: int = 128  # the SSD's chunk length (chunk_size)
    seq_len: int = 8192
    tie_embeddings: bool = False
    # what `llama.attention` reads: no position encoding, no biases, no norm of the heads
    rope = qkv_bias = o_bias = qk_norm = False

    def __attrs_post_init__(self):
        problems = []
        unknown = sorted(set(self.pattern) - set(REGIONS))
        if not self.pattern or unknown:
            problems.append(f"pattern {self.pattern!r} is not a string of {', '.join(REGIONS)}")
        if MOE in self.pattern and not (0 < self.experts_per_token <= self.experts
                                        and self.moe_d_ff > 0):
            problems.append("its E layers need experts, experts per token (at most the experts) "
                            "and an expert width")
        if MLP in self.pattern and self.d_ff <= 0:
            problems.append("its - layers need an MLP width")
        if ATTENTION in self.pattern and self.heads % self.kv_heads:
            problems.append(f"{self.heads} heads are not a multiple of {self.kv_heads} KV heads")
        if MAMBA in self.pattern and self.mamba_heads % self.groups:
            problems.append(f"{self.mamba_heads} Mamba heads are not a multiple of "
                            f"{self.groups} groups")
        if problems:
            raise OpgraphError(f"{self.name}: {'; '.join(problems)}")

    def counts(self) -> dict[str, int]:
        """Layers of each kind, in the graph's order."""
        return {c: self.pattern.count(c) for c in REGIONS if c in self.pattern}

    def dims(self) -> dict:
        dims = {D: self.d_model, L: len(self.pattern), V: self.vocab, S: self.seq_len, B: 1}
        if ATTENTION in self.pattern:
            dims |= {H: self.heads, H_kv: self.kv_heads, d_h: self.head_dim}
        if MAMBA in self.pattern:
            dims |= {H_m: self.mamba_heads, d_m: self.mamba_head_dim, N_m: self.state,
                     G_m: self.groups, Q_m: self.chunk, k_m: self.conv_width}
        if MLP in self.pattern:
            dims[F] = self.d_ff
        if MOE in self.pattern:
            dims |= {E: self.experts, K: self.experts_per_token, F_e: self.moe_d_ff}
            if self.shared_d_ff:
                dims[F_s] = self.shared_d_ff
        return dims


# Megatron-Bridge's `nemotron_3_nano_pretrain_8gpu_h100_bf16_config` (hybrid_layer_pattern and
# widths; src/megatron/bridge/recipes/nemotronh/h100/nemotron_3_nano.py); HF
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: 31.6 B parameters, 3.2 B active (arXiv:2512.20848).
NEMOTRON_3_NANO = NemotronHConfig(
    "nemotron-3-nano-30b-a3b", d_model=2688,
    pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    heads=32, kv_heads=2, head_dim=128, mamba_heads=64, mamba_head_dim=64, state=128, groups=8,
    vocab=131072, experts=128, experts_per_token=6, moe_d_ff=1856, shared_d_ff=3712)
# Megatron-Bridge's `NemotronHModelProvider8B` and its base (`NemotronHModelProvider`: groups 8,
# Mamba head 64, 8 KV heads); Nemotron-H (arXiv:2504.03624), Table 1.
NEMOTRON_H_8B = NemotronHConfig(
    "nemotron-h-8b", d_model=4096,
    pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    heads=32, kv_heads=8, head_dim=128, mamba_heads=128, mamba_head_dim=64, state=128, groups=8,
    vocab=131072, d_ff=21504)


def build(config: NemotronHConfig) -> Graph:
    """The forward graph of one training step: `build(NEMOTRON_3_NANO)`."""
    g = GraphBuilder(config.name, config.dims())
    tokens, targets = g.input("tokens", (B, S)), g.input("targets", (B, S))
    embed = g.weight("embed.weight", (V, D))
    x = g.embedding(tokens, embed, name="embed")
    for layer, count in config.counts().items():
        with g.repeat(count, REGIONS[layer]):
            h = g.rmsnorm(x, g.weight("norm.weight", (D,)), name="norm")
            x = g.add(x, _MIXERS[layer](g, h, config), name="residual")
    x = g.rmsnorm(x, g.weight("final_norm.weight", (D,)), name="final_norm")
    g.output_head(x, embed, targets, tied=config.tie_embeddings)
    graph = g.build()
    graph.seq_len = config.seq_len
    return graph


def mamba2(g: GraphBuilder, h, config: NemotronHConfig):
    """Mamba-2's mixer of the normed input `h` (see the module), up to `out_proj`."""
    inner, bc = H_m * d_m, G_m * N_m
    zxbcdt = g.matmul(h, g.weight("in_proj.weight", (D, 2 * inner + 2 * bc + H_m)),
                      name="in_proj")
    # views: mamba_ssm's kernels read each piece through its strides
    z, xbc, dt = g.split(zxbcdt, (inner, inner + 2 * bc, H_m), strided=True, name="in_split")
    xbc = g.op("causal_conv1d", [xbc, g.weight("conv1d.weight", (inner + 2 * bc, k_m)),
                                 g.weight("conv1d.bias", (inner + 2 * bc,))],
               category="scan", name="conv1d")
    x, b, c = g.split(xbc, (inner, bc, bc), strided=True, name="xbc_split")
    per_head = [g.weight(f"{n}", (H_m,)) for n in ("dt_bias", "A_log")]
    scan = {"heads": H_m, "groups": G_m, "chunk": Q_m}
    states = g.op("ssd_chunk_state", [x, dt, *per_head, b], category="scan", dtype=FP32,
                  name="chunk_state", **scan)
    y = g.op("ssd_chunk_scan", [x, dt, *per_head, b, c, g.weight("D", (H_m,)), states],
             category="scan", name="chunk_scan", **scan)
    y = g.swiglu(z, y, name="gate")  # y * silu(z)
    y = g.op("rmsnorm", [y, g.weight("mixer_norm.weight", (inner,))], category="norm",
             name="mixer_norm", groups=G_m)  # over each group's inner / G_m
    return g.matmul(y, g.weight("out_proj.weight", (inner, D)), name="out_proj")


def relu2_mlp(g: GraphBuilder, h, width=F, prefix: str = ""):
    """`down(relu(up(h))^2)`, of hidden width `width`, named under `prefix`."""
    up = g.matmul(h, g.weight(f"{prefix}up_proj.weight", (D, width)), name=f"{prefix}up_proj")
    a = g.op("relu2", [up], category="elementwise", name=f"{prefix}relu2")
    return g.matmul(a, g.weight(f"{prefix}down_proj.weight", (width, D)),
                    name=f"{prefix}down_proj")


def relu2_moe(g: GraphBuilder, h, config: NemotronHConfig):
    """A router over E ReLU-squared experts, each token through its top K, plus the shared
    expert (where the configuration has one)."""
    logits = g.matmul(h, g.weight("router.weight", (D, E)), name="router")
    gates, experts = g.topk(logits, K, name="router_topk")
    slots = g.moe_permute(h, experts, name="experts.permute")
    up = g.expert_matmul(slots, g.weight("experts.up_proj.weight", (E, D, F_e)), experts,
                         name="experts.up_proj")
    a = g.op("relu2", [up], category="elementwise", name="experts.relu2")
    down = g.expert_matmul(a, g.weight("experts.down_proj.weight", (E, F_e, D)), experts,
                           name="experts.down_proj")
    routed = g.moe_combine(down, gates, name="experts.combine")
    if not config.shared_d_ff:
        return routed
    return g.add(relu2_mlp(g, h, F_s, "shared_expert."), routed, name="experts.sum")


_MIXERS = {MAMBA: mamba2, ATTENTION: attention, MLP: lambda g, h, config: relu2_mlp(g, h),
           MOE: relu2_moe}
