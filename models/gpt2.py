"""GPT-2 (and GPT-3, the same architecture scaled) as an op graph, from its configuration;
with flags, the other LayerNorm decoders of its lineage (OPT, GPT-NeoX, BLOOM, Falcon).

One op per kernel of a straightforward implementation: the token and the position embedding
lookups and their sum; per layer LayerNorm (weight and bias); Q, K, V projections with biases
(GPT-2's fused `c_attn` held as three projections: the same FLOPs and parameters); the causal
attention core (multi-head, no RoPE); the output projection with its bias; residual add;
LayerNorm; the MLP (`c_fc` with bias, GELU, `c_proj` with bias); residual add. Then the final
LayerNorm, the output head and the loss.

The output head is tied to the token embedding: it reads the `[V, D]` table transposed, so the
table counts once as a parameter and, read by a matmul, counts for the MFU convention; the
position table is read only by its lookup, so it does not.

The flags of `GPT2Config`, each off for GPT-2, say how a relative differs:
- `positions=None`: no learned position table (RoPE or ALiBi instead); `position_offset`: rows
  the table has beyond the context (OPT's 2).
- `rotary=R`: RoPE on Q and K, on R of each head's dimensions (all of them: Llama's op).
- `alibi`: ALiBi's per-head bias on the scores (`attention(..., alibi=True)`).
- `kv_heads`: grouped-query (or, 1, multi-query) attention, as Llama's.
- `activation`: the MLP's, "gelu_tanh" (GPT-2's), "gelu" (exact), "relu" (OPT's) or "relu2"
  (ReLU squared: Nemotron-4's).
- `attention_bias=False`, `mlp_bias=False`: no bias on the attention's projections, on the
  MLP's (Falcon: neither); LayerNorms keep theirs.
- `parallel`: attention and MLP both read the layer's input (GPT-J's parallel residual:
  x + attn(ln_1(x)) + mlp(ln_2(x)); `shared_norm`: one LayerNorm feeds both, Falcon-7B's).
- `post_norm`: the LayerNorm after each residual add and no final one (OPT-350M);
  `residual_from_norm`: the residual branch starts from the LayerNorm's output (BLOOM's
  `apply_residual_connection_post_layernorm`).
- `embed_norm`: a LayerNorm on the embeddings (BLOOM's `word_embeddings_layernorm`).
- `embed_proj=D_w`: the token table is `[V, D_w]`, projected in to D and out from D (OPT-350M's
  `word_embed_proj_dim`).
"""

from __future__ import annotations

import attrs

from opgraph.core.builder import GraphBuilder
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph
from opgraph.core.symbols import B, D, F, H, H_kv, L, S, V, d_h, dim

P = dim("P")  # rows of the learned position table (n_positions), the longest sequence
R = dim("R")  # dimensions of each head RoPE rotates (GPT-NeoX's rotary_pct of d_h)
D_w = dim("D_w")  # the token embedding's width where it differs from D (OPT's projection)

ACTIVATIONS = ("gelu_tanh", "gelu", "relu", "relu2")
# GPT2Config's fields that make another architecture of the lineage (the module docstring)
VARIANT_FLAGS = ("position_offset", "kv_heads", "rotary", "alibi", "activation",
                 "attention_bias", "mlp_bias", "parallel", "shared_norm", "post_norm",
                 "residual_from_norm", "embed_norm", "embed_proj")


@attrs.frozen
class GPT2Config:
    name: str
    d_model: int
    layers: int
    heads: int
    vocab: int
    positions: int | None  # n_positions: the position table's rows; None: no table
    d_ff: int | None = None  # None: 4 x d_model
    seq_len: int | None = None  # default sequence length of a profile; None: `positions`
    tie_embeddings: bool = True
    position_offset: int = 0  # rows the position table has beyond `positions` (OPT: 2)
    kv_heads: int | None = None  # None: multi-head attention (as many as `heads`)
    rotary: int | None = None  # RoPE on this many dims of each head; None: no RoPE
    alibi: bool = False
    activation: str = "gelu_tanh"
    attention_bias: bool = True
    mlp_bias: bool = True
    parallel: bool = False
    shared_norm: bool = False  # parallel: one LayerNorm feeds attention and MLP
    post_norm: bool = False
    residual_from_norm: bool = False
    embed_norm: bool = False
    embed_proj: int | None = None  # the token table's width, projected to d_model
    # training dropout on the attention probabilities (HF's attn_pdrop): a kernel between the
    # scores and P.V of the unfused core, reading and writing the [B, H, S, S] probabilities
    attention_dropout: float = 0.0

    def __attrs_post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise OpgraphError(f"GPT2Config {self.name}: activation {self.activation!r}; "
                               f"choose one of {', '.join(ACTIVATIONS)}")
        if self.positions is None and self.seq_len is None:
            raise OpgraphError(f"GPT2Config {self.name}: no position table and no seq_len; "
                               "give seq_len, the default sequence length of a profile")

    def variant_flags(self) -> tuple[str, ...]:
        """The flags set away from GPT-2's architecture (none for GPT-2 and GPT-3):
        `("positions", "rotary", "parallel")` for GPT-NeoX (no table, RoPE, parallel)."""
        fields = attrs.fields_dict(GPT2Config)
        flags = tuple(n for n in VARIANT_FLAGS if getattr(self, n) != fields[n].default)
        return (("positions",) if self.positions is None else ()) + flags

    def dims(self) -> dict:
        dims = {D: self.d_model, L: self.layers, H: self.heads,
                d_h: self.d_model // self.heads, F: self.d_ff or 4 * self.d_model,
                V: self.vocab, B: 1,
                S: self.seq_len or self.positions}
        if self.positions is not None:
            dims[P] = self.positions + self.position_offset
        if self.kv_heads is not None:
            dims[H_kv] = self.kv_heads
        if self.rotary is not None and self.rotary != self.d_model // self.heads:
            dims[R] = self.rotary
        if self.embed_proj is not None:
            dims[D_w] = self.embed_proj
        return dims


# Radford et al. 2019 (Language Models are Unsupervised Multitask Learners), the 124M model;
# HF openai-community/gpt2 config.json (attn_pdrop 0.1).
GPT2 = GPT2Config("gpt2", d_model=768, layers=12, heads=12, vocab=50257, positions=1024,
                  attention_dropout=0.1)
# arXiv:2005.14165 (Language Models are Few-Shot Learners), Table 2.1, GPT-3 175B. Its
# alternating locally banded sparse attention layers are profiled as dense causal attention.
GPT3_175B = GPT2Config("gpt3-175b", d_model=12288, layers=96, heads=96, vocab=50257,
                       positions=2048)


def build(config: GPT2Config) -> Graph:
    """The forward graph of one training step: `build(GPT2)`."""
    g = GraphBuilder(config.name, config.dims())
    tokens = g.input("tokens", (B, S))
    positions = g.input("positions", (B, S)) if config.positions is not None else None
    targets = g.input("targets", (B, S))
    width = D_w if config.embed_proj is not None else D
    wte = g.weight("wte.weight", (V, width))
    x = g.embedding(tokens, wte, name="wte")
    if config.embed_proj is not None:
        x = g.matmul(x, g.weight("project_in.weight", (D_w, D)), name="project_in")
    if positions is not None:
        x = g.add(x, g.embedding(positions, g.weight("wpe.weight", (P, D)), name="wpe"),
                  name="embed_sum")
    if config.embed_norm:
        x = layernorm(g, x, "embed_norm")
    with g.repeat(L, "layers"):
        x = _block(g, x, config)
    if not config.post_norm:
        x = layernorm(g, x, "ln_f")
    if config.embed_proj is not None:
        x = g.matmul(x, g.weight("project_out.weight", (D, D_w)), name="project_out")
    g.output_head(x, wte, targets, tied=config.tie_embeddings)
    graph = g.build()
    graph.seq_len = int(config.dims()[S])
    if config.positions is not None:
        graph.max_seq_len = config.positions
    return graph


def layernorm(g: GraphBuilder, x, name: str):
    return g.layernorm(x, g.weight(f"{name}.weight", (D,)), g.weight(f"{name}.bias", (D,)),
                       name=name)


def linear(g: GraphBuilder, x, name: str, d_in, d_out, bias: bool = True):
    """`x @ w + b` (or `x @ w` without a bias), one kernel."""
    w = g.weight(f"{name}.weight", (d_in, d_out))
    return g.matmul(x, w, g.weight(f"{name}.bias", (d_out,)) if bias else None, name=name)


def _block(g: GraphBuilder, x, config: GPT2Config):
    """One decoder layer: pre-norm multi-head attention, then a pre-norm GELU MLP (or, by the
    config's flags, post-norm, parallel, grouped-query, rotary, ALiBi, ReLU)."""
    kv = H_kv if config.kv_heads is not None else H
    h = x if config.post_norm else layernorm(g, x, "ln_1")
    residual = h if config.residual_from_norm else x
    q = linear(g, h, "q_proj", D, H * d_h, config.attention_bias)
    k = linear(g, h, "k_proj", D, kv * d_h, config.attention_bias)
    v = linear(g, h, "v_proj", D, kv * d_h, config.attention_bias)
    if config.rotary is not None:  # on R of each head's dims, or (as Llama's) on all of them
        rotated = R if config.rotary != config.d_model // config.heads else None
        q = g.rope(q, name="q_rope", rotary=rotated, heads=H)
        k = g.rope(k, name="k_rope", rotary=rotated, heads=kv)
    o = g.attention(q, k, v, heads=H, kv_heads=kv, causal=True, alibi=config.alibi,
                    dropout=config.attention_dropout or None, name="attn")
    attn = linear(g, o, "o_proj", H * d_h, D, config.attention_bias)
    if config.parallel:
        h = h if config.shared_norm else layernorm(g, x, "ln_2")
        x = g.add(residual, attn, name="attn_residual")
        return g.add(x, _mlp(g, h, config), name="mlp_residual")
    x = g.add(residual, attn, name="attn_residual")
    if config.post_norm:
        x = layernorm(g, x, "ln_1")
    h = x if config.post_norm else layernorm(g, x, "ln_2")
    residual = h if config.residual_from_norm else x
    x = g.add(residual, _mlp(g, h, config), name="mlp_residual")
    return layernorm(g, x, "ln_2") if config.post_norm else x


def _mlp(g: GraphBuilder, h, config: GPT2Config):
    """`proj(act(fc(h)))`, act GELU (tanh or exact), ReLU or ReLU squared."""
    a = linear(g, h, "fc", D, F, config.mlp_bias)
    if config.activation == "relu":
        a = g.relu(a, name="relu")
    elif config.activation == "relu2":
        a = g.op("relu2", [a], category="elementwise", name="relu2")
    else:
        a = g.gelu(a, approximate="tanh" if config.activation == "gelu_tanh" else "none",
                   name="gelu")
    return linear(g, a, "proj", F, D, config.mlp_bias)
