"""The builder API models are written with.

    g = GraphBuilder("tiny", dims={D: 64, S: 16, B: 1})
    x = g.input("x", (B, S, D))
    w = g.weight("w", (D, D))
    y = g.matmul(x, w, name="proj")
    graph = g.build()

Each method makes one op (one kernel of a straightforward implementation): it infers the output
shapes with the kind's shape rule (`opgraph.rules`), so a model says only what it computes; its
FLOPs and bytes are derived when the step is costed (`opgraph.costmodel`). Ops and tensors made inside `with g.repeat(L, "layers"):` are held once with
multiplicity `L`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import sympy

from . import rules
from .ir import BF16, FP32, INT32, DType, Graph, Op, Role, Tensor, _expr
from .verify import verify

TensorLike = Tensor | str


class GraphBuilder:
    def __init__(self, name: str, dims: dict | None = None, dtype: DType = BF16):
        self.graph = Graph(name, dims)
        self.dtype = dtype  # activations' and weights' dtype
        self._scopes: list[tuple[str, sympy.Expr]] = []
        self._used: dict[str, int] = {}

    # --- scopes -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def repeat(self, count, name: str) -> Iterator[None]:
        """Everything made inside is one layer of a stack of `count` identical layers."""
        self._scopes.append((name, _expr(count)))
        try:
            yield
        finally:
            self._scopes.pop()

    @property
    def count(self) -> sympy.Expr:
        return sympy.Mul(*(c for _, c in self._scopes))

    def _name(self, base: str) -> str:
        full = ".".join([*(n for n, _ in self._scopes), base])
        n = self._used.get(full, 0)
        self._used[full] = n + 1
        return full if n == 0 else f"{full}_{n}"

    def _get(self, t: TensorLike) -> Tensor:
        return self.graph.tensor(t) if isinstance(t, str) else t

    # --- leaves -------------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence, dtype: DType | None = None) -> Tensor:
        """Data fed to the step (token ids, targets); no gradient flows into it."""
        t = Tensor(self._name(name), shape, dtype or INT32, Role.INPUT, self.count)
        return self.graph.add_tensor(t)

    def activation(self, name: str, shape: Sequence, dtype: DType | None = None) -> Tensor:
        """An activation fed in from outside the graph (for patterns and small tests)."""
        t = Tensor(self._name(name), shape, dtype or self.dtype, Role.ACTIVATION, self.count)
        return self.graph.add_tensor(t)

    def weight(self, name: str, shape: Sequence, dtype: DType | None = None) -> Tensor:
        """A trained parameter; inside a repeat, one per layer."""
        t = Tensor(self._name(name), shape, dtype or self.dtype, Role.WEIGHT, self.count)
        return self.graph.add_tensor(t)

    # --- the generic op -----------------------------------------------------------------------
    def op(self, kind: str, inputs: Sequence[TensorLike], *, category: str, name: str | None = None,
           dtype: DType | tuple[DType, ...] | None = None, **params) -> Tensor:
        """One op of a kind in `opgraph.rules`; returns its (first) output. Its outputs are
        named `name`, `name:1`, ...; `dtype` is theirs (a tuple: one per output)."""
        ins = [self._get(t) for t in inputs]
        params = {k: _expr(v) if isinstance(v, int | sympy.Basic) and not isinstance(v, bool)
                  else v for k, v in params.items()}
        shapes = rules.infer_shapes(kind, ins, params)
        op_name = self._name(name or kind)
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,) * len(shapes)  # one per output
        outs = [Tensor(op_name if i == 0 else f"{op_name}:{i}", shape, dtypes[i] or self.dtype,
                       Role.ACTIVATION, self.count)
                for i, shape in enumerate(shapes)]
        for t in outs:
            self.graph.add_tensor(t)
        self.graph.add_op(Op(op_name, kind, category, [t.name for t in ins],
                             [t.name for t in outs], count=self.count, params=params))
        return outs[0]

    # --- the ops models use -------------------------------------------------------------------
    def embedding(self, ids: TensorLike, table: TensorLike, name: str = "embed") -> Tensor:
        return self.op("embedding", [ids, table], category="embedding", name=name)

    def matmul(self, a: TensorLike, b: TensorLike, bias: TensorLike | None = None, *,
               name: str = "matmul", category: str = "matmul", **params) -> Tensor:
        """`x @ w` for a weight `w[K, N]` (`transpose_b=True` for `w[N, K]`), batched `a @ b`,
        or per-head `p @ v` with `heads=H, kv_heads=G`; `causal=True` counts the lower triangle."""
        ins = [a, b] if bias is None else [a, b, bias]
        return self.op("matmul", ins, category=category, name=name, **params)

    def rmsnorm(self, x: TensorLike, weight: TensorLike, name: str = "rmsnorm") -> Tensor:
        return self.op("rmsnorm", [x, weight], category="norm", name=name)

    def layernorm(self, x: TensorLike, weight: TensorLike, bias: TensorLike,
                  name: str = "layernorm") -> Tensor:
        return self.op("layernorm", [x, weight, bias], category="norm", name=name)

    def rope(self, x: TensorLike, name: str = "rope") -> Tensor:
        return self.op("rope", [x], category="elementwise", name=name)

    def attention_scores(self, q: TensorLike, k: TensorLike, *, heads, kv_heads,
                         causal: bool = True, name: str = "scores") -> Tensor:
        """softmax(mask(QK^T * scale)) per head: `[B, S, H*d], [B, S, G*d] -> [B, H, S, S]`."""
        return self.op("attention_scores", [q, k], category="attention", name=name,
                       heads=heads, kv_heads=kv_heads, causal=causal)

    def attention(self, q: TensorLike, k: TensorLike, v: TensorLike, *, heads, kv_heads,
                  causal: bool = True, name: str = "attn") -> Tensor:
        """The unfused attention core: a scores kernel, then P.V (what `fuse_attention` finds)."""
        p = self.attention_scores(q, k, heads=heads, kv_heads=kv_heads, causal=causal,
                                  name=f"{name}.scores")
        return self.matmul(p, v, name=f"{name}.pv", category="attention",
                           heads=heads, kv_heads=kv_heads, causal=causal)

    def flash_attention(self, q: TensorLike, k: TensorLike, v: TensorLike, *, heads, kv_heads,
                        causal: bool = True, name: str = "flash_attn") -> Tensor:
        return self.op("flash_attention", [q, k, v], category="attention", name=name,
                       heads=heads, kv_heads=kv_heads, causal=causal)

    def swiglu(self, gate: TensorLike, up: TensorLike, name: str = "swiglu") -> Tensor:
        """`silu(gate) * up`, one kernel."""
        return self.op("swiglu", [gate, up], category="elementwise", name=name)

    def gelu(self, x: TensorLike, name: str = "gelu") -> Tensor:
        return self.op("gelu", [x], category="elementwise", name=name)

    def add(self, a: TensorLike, b: TensorLike, name: str = "add") -> Tensor:
        return self.op("add", [a, b], category="elementwise", name=name)

    def cross_entropy(self, logits: TensorLike, targets: TensorLike,
                      name: str = "loss") -> Tensor:
        return self.op("cross_entropy", [logits, targets], category="output_head", name=name,
                       dtype=FP32)

    def output_head(self, x: TensorLike, table: TensorLike, targets: TensorLike, *,
                    tied: bool = False, bias: bool = False) -> Tensor:
        """Logits over the vocabulary, then the loss: a new `lm_head.weight [D, V]`, or with
        `tied=True` the embedding `table [V, D]` read transposed (one parameter, two readers)."""
        table = self._get(table)
        vocab, width = table.shape
        weight = table if tied else self.weight("lm_head.weight", (width, vocab))
        head_bias = self.weight("lm_head.bias", (vocab,)) if bias else None
        logits = self.matmul(x, weight, head_bias, name="lm_head", category="output_head",
                             **({"transpose_b": True} if tied else {}))
        return self.cross_entropy(logits, targets, name="loss")

    # --- mixture of experts ---------------------------------------------------------------
    def topk(self, logits: TensorLike, k, name: str = "topk") -> tuple[Tensor, Tensor]:
        """The router's softmax and top-`k`: `[..., E] -> gates [..., k], expert ids [..., k]`."""
        gates = self.op("topk", [logits], category="routing", name=name,
                        dtype=(self.dtype, INT32), k=k)
        return gates, self.graph.tensor(f"{gates.name}:1")

    def expert_matmul(self, x: TensorLike, w: TensorLike, experts: TensorLike, *,
                      name: str = "expert_matmul") -> Tensor:
        """Each token through its routed experts, `w[E, in, out]`: `x[..., in] -> [..., k, out]`
        (or `[..., k, in] -> [..., k, out]`); FLOPs count k experts per token, not E."""
        return self.op("expert_matmul", [x, w, experts], category="matmul", name=name)

    def moe_combine(self, y: TensorLike, gates: TensorLike, name: str = "combine") -> Tensor:
        """The gate-weighted sum of each token's expert outputs: `[..., k, D] -> [..., D]`."""
        return self.op("moe_combine", [y, gates], category="routing", name=name)

    def build(self) -> Graph:
        """The finished graph, verified."""
        verify(self.graph)
        return self.graph
