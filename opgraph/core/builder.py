"""The builder API models are written with.

    g = GraphBuilder("tiny", dims={D: 64, S: 16, B: 1})
    x = g.input("x", (B, S, D))
    w = g.weight("w", (D, D))
    y = g.matmul(x, w, name="proj")
    graph = g.build()

Each method makes one op (one kernel of a straightforward implementation): it infers the output
shapes with the kind's shape rule (`opgraph.core.rules`), so a model says only what it computes; its
FLOPs and bytes are derived when the step is costed (`opgraph.cost.costmodel`). Ops and tensors made
inside `with g.repeat(L, "layers") as layer:` are held once with multiplicity `L`, tagged with
the region `repeat` makes; `layer.carry(x_in, x_out)` declares what one iteration hands the
next, and `build()` infers it for a region that declares nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import attrs
import sympy

from . import rules
from .errors import OpgraphError
from .ir import BF16, FP32, INT32, DType, Graph, Op, Region, Role, Tensor, _expr
from .verify import verify

TensorLike = Tensor | str


class RegionHandle:
    """What `with g.repeat(L, "layers") as layer:` yields: the region's name, and `carry` to
    declare its loop-carried tensors."""

    def __init__(self, builder: GraphBuilder, name: str):
        self._builder = builder
        self.name = name

    def carry(self, entering: TensorLike, handed: TensorLike) -> None:
        """Declare that `handed`, made by an iteration, is what the next iteration reads in
        place of `entering` (the tensor made before the region that iteration 0 reads). Once a
        region declares a carry, `build()` infers none for it."""
        names = tuple(t if isinstance(t, str) else t.name for t in (entering, handed))
        self._builder._carries.setdefault(self.name, []).append(names)


class GraphBuilder:
    def __init__(self, name: str, dims: dict | None = None, dtype: DType = BF16):
        self.graph = Graph(name, dims)
        self.dtype = dtype  # activations' and weights' dtype
        self._stack: list[Region] = []  # the regions being built, outermost first
        self._carries: dict[str, list[tuple[str, str]]] = {}  # declared, by region
        self._used: dict[str, int] = {}

    # --- regions ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def repeat(self, count, name: str) -> Iterator[RegionHandle]:
        """Everything made inside is one layer of a stack of `count` identical layers: one
        region of the graph, named `name` (inside another repeat, `outer.name`; made unique
        with `_1`, `_2`, ... if a model repeats under the same name twice). Ops inside are
        named under it, `layers.q_proj`."""
        parent = self._stack[-1].name if self._stack else None
        base = name if parent is None else f"{parent}.{name}"
        unique, n = base, 0
        while unique in {r.name for r in self.graph.regions()}:
            n += 1
            unique = f"{base}_{n}"
        region = self.graph.add_region(Region(unique, count, parent))
        self._stack.append(region)
        try:
            yield RegionHandle(self, unique)
        finally:
            self._stack.pop()

    @property
    def count(self) -> sympy.Expr:
        return sympy.Mul(*(r.count for r in self._stack))

    @property
    def region(self) -> str | None:
        """The innermost region being built, None outside every repeat."""
        return self._stack[-1].name if self._stack else None

    def _name(self, base: str) -> str:
        full = base if not self._stack else f"{self._stack[-1].name}.{base}"
        n = self._used.get(full, 0)
        self._used[full] = n + 1
        return full if n == 0 else f"{full}_{n}"

    def _get(self, t: TensorLike) -> Tensor:
        return self.graph.tensor(t) if isinstance(t, str) else t

    # --- leaves -------------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence, dtype: DType | None = None) -> Tensor:
        """Data fed to the step (token ids, targets); no gradient flows into it."""
        t = Tensor(self._name(name), shape, dtype or INT32, Role.INPUT, self.count,
                   region=self.region)
        return self.graph.add_tensor(t)

    def activation(self, name: str, shape: Sequence, dtype: DType | None = None) -> Tensor:
        """An activation fed in from outside the graph (for patterns and small tests)."""
        t = Tensor(self._name(name), shape, dtype or self.dtype, Role.ACTIVATION, self.count,
                   region=self.region)
        return self.graph.add_tensor(t)

    def weight(self, name: str, shape: Sequence, dtype: DType | None = None) -> Tensor:
        """A trained parameter; inside a repeat, one per layer."""
        t = Tensor(self._name(name), shape, dtype or self.dtype, Role.WEIGHT, self.count,
                   region=self.region)
        return self.graph.add_tensor(t)

    # --- the generic op -----------------------------------------------------------------------
    def op(self, kind: str, inputs: Sequence[TensorLike], *, category: str, name: str | None = None,
           dtype: DType | tuple[DType, ...] | None = None, **params) -> Tensor:
        """One op of a kind in `opgraph.core.rules`; returns its (first) output. Its outputs are
        named `name`, `name:1`, ...; `dtype` is theirs (a tuple: one per output)."""
        ins = [self._get(t) for t in inputs]
        params = {k: _expr(v) if isinstance(v, int | sympy.Basic) and not isinstance(v, bool)
                  else v for k, v in params.items()}
        shapes = rules.infer_shapes(kind, ins, params)
        op_name = self._name(name or kind)
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,) * len(shapes)  # one per output
        outs = [Tensor(op_name if i == 0 else f"{op_name}:{i}", shape, dtypes[i] or self.dtype,
                       Role.ACTIVATION, self.count, region=self.region)
                for i, shape in enumerate(shapes)]
        for t in outs:
            self.graph.add_tensor(t)
        self.graph.add_op(Op(op_name, kind, category, [t.name for t in ins],
                             [t.name for t in outs], count=self.count, params=params,
                             region=self.region))
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

    def rope(self, x: TensorLike, name: str = "rope", *, rotary=None, heads=None) -> Tensor:
        """Rotary position embedding on `x[B, S, heads*d]`; `rotary=R, heads=H` rotates only
        R of each head's d dimensions (GPT-NeoX's partial RoPE), the rest pass through."""
        params = {} if rotary is None else {"rotary": rotary, "heads": heads}
        return self.op("rope", [x], category="elementwise", name=name, **params)

    def attention_scores(self, q: TensorLike, k: TensorLike, *, heads, kv_heads,
                         causal: bool = True, window=None, softcap=None, alibi: bool = False,
                         name: str = "scores") -> Tensor:
        """softmax(mask(QK^T * scale)) per head: `[B, S, H*d], [B, S, G*d] -> [B, H, S, S]`;
        `window=W` lets each query see its last W keys (sliding-window attention: FLOPs count
        min(S, W) keys per query), `softcap=c` caps the logits, c * tanh(s / c); `alibi=True`
        adds ALiBi's per-head linear bias to each score (BLOOM) in the same kernel."""
        return self.op("attention_scores", [q, k], category="attention", name=name,
                       **_attention_params(heads, kv_heads, causal, window, softcap, alibi))

    def attention(self, q: TensorLike, k: TensorLike, v: TensorLike, *, heads, kv_heads,
                  causal: bool = True, window=None, softcap=None, alibi: bool = False,
                  dropout: float | None = None, name: str = "attn") -> Tensor:
        """The unfused attention core: a scores kernel, then P.V (what `fuse_attention` finds);
        `dropout=p` drops the probabilities between them (a kernel of its own, GPT-2's
        `attn_pdrop`). The values' head size may differ from the queries' and keys' (DeepSeek's
        MLA)."""
        p = self.attention_scores(q, k, heads=heads, kv_heads=kv_heads, causal=causal,
                                  window=window, softcap=softcap, alibi=alibi,
                                  name=f"{name}.scores")
        if dropout:
            p = self.dropout(p, dropout, name=f"{name}.dropout")
        return self.matmul(p, v, name=f"{name}.pv", category="attention",
                           **_attention_params(heads, kv_heads, causal, window, softcap, alibi))

    def flash_attention(self, q: TensorLike, k: TensorLike, v: TensorLike, *, heads, kv_heads,
                        causal: bool = True, window=None, softcap=None, alibi: bool = False,
                        name: str = "flash_attn") -> Tensor:
        return self.op("flash_attention", [q, k, v], category="attention", name=name,
                       **_attention_params(heads, kv_heads, causal, window, softcap, alibi))

    def swiglu(self, gate: TensorLike, up: TensorLike, name: str = "swiglu") -> Tensor:
        """`silu(gate) * up`, one kernel."""
        return self.op("swiglu", [gate, up], category="elementwise", name=name)

    def gelu(self, x: TensorLike, approximate: str = "tanh", name: str = "gelu") -> Tensor:
        """GELU: `approximate="tanh"` (GPT-2's) or `"none"` (exact, with erf: BERT's)."""
        return self.op("gelu", [x], category="elementwise", name=name,
                       **({} if approximate == "tanh" else {"approximate": approximate}))

    def geglu(self, gate: TensorLike, up: TensorLike, approximate: str = "tanh",
              name: str = "geglu") -> Tensor:
        """`gelu(gate) * up`, one kernel (Gemma's MLP)."""
        return self.op("geglu", [gate, up], category="elementwise", name=name,
                       **({} if approximate == "tanh" else {"approximate": approximate}))

    def relu(self, x: TensorLike, name: str = "relu") -> Tensor:
        """`max(x, 0)` (OPT's MLP)."""
        return self.op("relu", [x], category="elementwise", name=name)

    def dropout(self, x: TensorLike, p: float, name: str = "dropout") -> Tensor:
        """Training dropout, `x * mask / (1 - p)`: each element dropped with probability `p`."""
        return self.op("dropout", [x], category="elementwise", name=name, p=p)

    def mul(self, a: TensorLike, b: TensorLike, name: str = "mul") -> Tensor:
        """An element-wise product of two tensors of one shape."""
        return self.op("mul", [a, b], category="elementwise", name=name)

    def scale(self, x: TensorLike, factor, name: str = "scale") -> Tensor:
        """`x * factor`, a constant (Gemma's embedding times sqrt(d_model))."""
        return self.op("scale", [x], category="elementwise", name=name, factor=factor)

    def softcap(self, x: TensorLike, cap, name: str = "softcap") -> Tensor:
        """`cap * tanh(x / cap)`: soft-capping (Gemma 2's final logits)."""
        return self.op("softcap", [x], category="elementwise", name=name, cap=cap)

    # --- views and data movement (free when a view: `rules.VIEWS`), filed as element-wise ----
    def slice(self, x: TensorLike, size, *, start=0, axis: int = -1, copy: bool = False,
              name: str = "slice") -> Tensor:
        """`x[..., start:start+size]` along `axis`: a view when contiguous, else a copy."""
        return self.op("slice", [x], category="elementwise", name=name, size=size, start=start,
                       axis=axis, **({"copy": True} if copy else {}))

    def split(self, x: TensorLike, sizes: Sequence, *, axis: int = -1, copy: bool = False,
              strided: bool = False, name: str = "split") -> list[Tensor]:
        """`x` cut along `axis` into pieces of `sizes`: views when contiguous, else copies;
        `strided`: views whatever the cut, the readers taking strided inputs."""
        first = self.op("split", [x], category="elementwise", name=name, sizes=tuple(sizes),
                        axis=axis, **({"copy": True} if copy else {}),
                        **({"strided": True} if strided else {}))
        return [first] + [self.graph.tensor(f"{first.name}:{i}") for i in range(1, len(sizes))]

    def concat(self, xs: Sequence[TensorLike], *, axis: int = -1, in_place: bool = False,
               name: str = "concat") -> Tensor:
        """`xs` joined along `axis` (each head's parts): a copy, unless `in_place` (the
        producers wrote into one buffer)."""
        return self.op("concat", list(xs), category="elementwise", name=name, axis=axis,
                       **({"in_place": True} if in_place else {}))

    def broadcast(self, x: TensorLike, shape: Sequence, name: str = "broadcast") -> Tensor:
        """`x` expanded to `shape` (dims of 1 repeated): a view."""
        return self.op("broadcast", [x], category="elementwise", name=name, shape=tuple(shape))

    def reshape(self, x: TensorLike, shape: Sequence, name: str = "reshape") -> Tensor:
        """`x` read as `shape` (`[B, S, H*d] -> [B, S, H, d]`): a view."""
        return self.op("reshape", [x], category="elementwise", name=name, shape=tuple(shape))

    def gather(self, x: TensorLike, index: TensorLike, name: str = "gather") -> Tensor:
        """Rows of `x[B, S, ...]` at `index[B, M]` -> `[B, M, ...]` (masked-LM positions)."""
        return self.op("gather", [x, index], category="elementwise", name=name)

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

    def moe_permute(self, x: TensorLike, experts: TensorLike, name: str = "permute") -> Tensor:
        """Each token copied to each of its k experts' slots, grouped by expert, as a
        dispatcher does before the expert GEMMs: `[..., D] -> [..., k, D]`."""
        return self.op("moe_permute", [x, experts], category="routing", name=name)

    def moe_combine(self, y: TensorLike, gates: TensorLike, name: str = "combine") -> Tensor:
        """The gate-weighted sum of each token's expert outputs: `[..., k, D] -> [..., D]`."""
        return self.op("moe_combine", [y, gates], category="routing", name=name)

    def build(self) -> Graph:
        """The finished graph, verified, each region with its carries (declared or inferred)."""
        if self._stack:
            raise OpgraphError(f"graph {self.graph.name}: build() inside repeat "
                               f"{self._stack[-1].name!r}; call it after the `with` block")
        for region in self.graph.regions():
            declared = self._carries.get(region.name)
            carries = (_checked_carries(self.graph, region, declared) if declared
                       else infer_carries(self.graph, region))
            self.graph.update_region(attrs.evolve(region, carries=carries))
        verify(self.graph)
        return self.graph


def _attention_params(heads, kv_heads, causal, window, softcap, alibi=False) -> dict:
    """An attention op's parameters; a window, a cap or ALiBi only when given."""
    params = {"heads": heads, "kv_heads": kv_heads, "causal": causal}
    if window is not None:
        params["window"] = window
    if softcap is not None:
        params["softcap"] = softcap
    if alibi:
        params["alibi"] = True
    return params


# --- loop-carried tensors ---------------------------------------------------------------------

def _same_type(a: Tensor, b: Tensor) -> bool:
    return (a.dtype == b.dtype and len(a.shape) == len(b.shape)
            and all(rules.same(x, y) for x, y in zip(a.shape, b.shape)))


def _type(t: Tensor) -> str:
    return f"{t.dtype.name}[{', '.join(map(str, t.shape))}]"


def region_boundary(graph: Graph, region: Region) -> tuple[list[Tensor], list[Tensor]]:
    """The activations made outside `region` that its ops read (in the order first read), and
    the activations made inside it that an op after it reads (in the order made)."""
    inside = [op for op in graph.ops() if graph.within(op.region, region.name)]
    mine = {op.name for op in inside}
    entering = dict.fromkeys(
        n for op in inside for n in op.inputs
        if graph.tensor(n).role is Role.ACTIVATION
        and not graph.within(graph.tensor(n).region, region.name))
    leaving = dict.fromkeys(
        n for op in inside for n in op.outputs
        if graph.tensor(n).role is Role.ACTIVATION
        and any(c.name not in mine for c in graph.consumers(n)))
    return [graph.tensor(n) for n in entering], [graph.tensor(n) for n in leaving]


def infer_carries(graph: Graph, region: Region) -> tuple[tuple[str, str], ...]:
    """Pair each activation leaving `region` with the one activation entering it of the same
    shape and dtype: what one iteration hands the next (JAX's scan carry). A leaving tensor
    that fits no entering one is not carried (a per-iteration output); an entering one that
    fits no leaving one is read by every iteration unchanged (a constant of the loop). Raises
    OpgraphError when a pairing is ambiguous, asking for `carry` to be declared."""
    entering, leaving = region_boundary(graph, region)
    pairs = []
    for out in leaving:
        fits = [t for t in entering if _same_type(t, out)]
        rivals = [o for o in leaving if any(_same_type(t, o) for t in fits)]
        if len(fits) > 1 or len(rivals) > 1:
            raise OpgraphError(
                f"graph {graph.name}: cannot tell what region {region.name!r} hands its next "
                f"iteration: {', '.join(o.name for o in rivals)} leave it and "
                f"{', '.join(t.name for t in fits)} enter it, all {_type(out)}; declare it "
                f"with `with g.repeat(...) as r:` ... `r.carry(entering, handed)`")
        if fits:
            pairs.append((fits[0].name, out.name))
    return tuple(pairs)


def _checked_carries(graph: Graph, region: Region,
                     declared: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The declared carries, each checked: the entering tensor made outside the region and
    read inside it, the handed tensor made inside it, both of one shape and dtype."""
    def fail(why: str):
        raise OpgraphError(f"graph {graph.name}: region {region.name!r} cannot carry "
                           f"{entering} -> {handed}: {why}")

    inside = {op.name for op in graph.ops() if graph.within(op.region, region.name)}
    for entering, handed in declared:
        for name in (entering, handed):
            if not graph.has_tensor(name):
                fail(f"no tensor {name!r}")
        a, b = graph.tensor(entering), graph.tensor(handed)
        if graph.within(a.region, region.name):
            fail(f"{entering} is made inside the region; carry the tensor made before it")
        if not any(op.name in inside for op in graph.consumers(entering)):
            fail(f"no op of the region reads {entering}")
        if not graph.within(b.region, region.name):
            fail(f"{handed} is not made inside the region")
        if not _same_type(a, b):
            fail(f"{entering} is {_type(a)} but {handed} is {_type(b)}")
    if len({a for a, _ in declared}) != len(declared) or len({b for _, b in declared}) != len(
            declared):
        raise OpgraphError(f"graph {graph.name}: region {region.name!r} declares a tensor in "
                           f"two carries")
    return tuple(declared)
