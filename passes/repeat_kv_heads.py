"""repeat_kv_heads: a framework whose model copies grouped-query attention's keys and values to
every query head before the attention kernel.

Invariant established: where the layout's framework does (`frameworks.Traits.repeats_kv_heads`),
every attention op with fewer key/value heads than query heads (its `kv_heads` and `heads`)
reads its keys and values (`rules.key_value_inputs`) through a `repeat_heads` copy at `heads`
heads, and says `kv_heads` = `heads`. FLOPs do not change. The copies' bytes and their
backward (the copies' gradients summed) are added; the kernel reads, and keeps for its
backward, H / H_kv times the keys and values; the passes after it see the copies where they saw
the keys and values: context parallelism's ring gathers them at that size, tensor parallelism
splits them by heads as it does the queries.

Why it matters: torchtitan's Llama runs `repeat_kv` on the keys and values before SDPA
(`torchtitan/models/llama/model.py` at 9dec370; `frameworks.Traits.repeats_kv_heads` says
which versions). For Llama 3 8B (32 query heads, 8 key/value heads) each layer's saved keys and
values grow four times, and under context parallelism the keys and values a ring moves too.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("llama3-8b"), Parallel(dp=8, zero=3, framework="torchtitan"))
    >>> g.op("layers.attn.flash").inputs[1], g.op("layers.attn.flash").param("kv_heads")
    ('layers.k_rope@repeat', H)
"""

from __future__ import annotations

import attrs
import sympy

from opgraph.core import rules
from opgraph.core.contracts import FORWARD, step_pass
from opgraph.core.ir import Graph, Op
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel


def _grouped(graph: Graph, op: Op) -> bool:
    """Whether attention op `op` has fewer key/value heads than query heads (its parameters
    at the graph's dimensions)."""
    heads, groups = op.param("heads"), op.param("kv_heads")
    if heads is None or groups is None or not rules.key_value_inputs(op):
        return False
    return (sympy.sympify(heads) / sympy.sympify(groups)).xreplace(graph.dims) != 1


@step_pass(at=FORWARD + 1, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (traits(p).repeats_kv_heads,)})
def repeat_kv_heads(graph: Graph, layout: Parallel) -> Graph:
    """`graph` (a forward graph) with each grouped-query attention's keys and values copied to
    every query head where the layout's framework does (see the module); `graph` itself
    otherwise, or where no attention groups its heads."""
    if not traits(layout).repeats_kv_heads:
        return graph
    grouped = [op for op in graph.ops() if _grouped(graph, op)]
    if not grouped:
        return graph
    out = graph.copy()
    copies: dict[str, str] = {}  # keys or values -> their copy at every head
    for op in grouped:
        heads = op.param("heads")
        params = {"heads": heads, "kv_heads": op.param("kv_heads")}
        inputs = list(op.inputs)
        for i in rules.key_value_inputs(op):
            name = inputs[i]
            if name not in copies:
                source = graph.tensor(name)
                (shape,) = rules.infer_shapes("repeat_heads", [source], params)
                copy = out.add_tensor(attrs.evolve(source, name=f"{name}@repeat", shape=shape),
                                      before=op.name)
                out.add_op(Op(f"{name}.repeat", "repeat_heads", "elementwise", (name,),
                              (copy.name,), count=op.count, params=params, region=op.region),
                           before=op.name)
                copies[name] = copy.name
            inputs[i] = copies[name]
        out.replace_op(attrs.evolve(op, inputs=tuple(inputs),
                                    params={**dict(op.params), "kv_heads": heads}))
    return out
