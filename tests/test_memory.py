"""The step's HBM footprint, as formulas of the graph, and the warning when it does not fit."""

import json

import pytest
import sympy
from opgraph.models import preset
from opgraph.passes.attach_adamw import AdamW
from opgraph.passes.evaluate import resolve

from opgraph import GraphBuilder, attach_adamw, compile_step, derive_backward, evaluate, hardware
from opgraph.cost.memory import footprint
from opgraph.core.symbols import B, D, F, H, H_kv, L, S, V, d_h

H100 = hardware.get("h100-sxm")


@pytest.fixture(scope="module")
def llama():
    return preset("llama3-8b")


@pytest.fixture(scope="module")
def llama_step(llama):
    return compile_step(llama)


def test_weights_gradients_and_optimizer_per_parameter(llama_step):
    fp = footprint(llama_step)
    n = llama_step.parameters()
    assert sympy.expand(fp.weights - 2 * n) == 0  # BF16
    assert sympy.expand(fp.gradients - 4 * n) == 0  # FP32 accumulation buffer, one per weight
    assert sympy.expand(fp.optimizer - 12 * n) == 0  # FP32 master, first and second moments


def test_saved_activations_with_their_multiplicity(llama_step):
    per_layer = 2 * B * S * (4 * D + 2 * H * d_h + 2 * H_kv * d_h + 3 * F)
    # x, the norm outputs, Q and K after RoPE, V, the attention output, the residual, gate, up
    # and their SwiGLU; around the stack the embedding, the final norm, the logits and the ids
    around = 2 * 2 * B * S * D + 2 * B * S * V + 2 * 4 * B * S
    assert sympy.expand(footprint(llama_step).activations - L * per_layer - around) == 0


def test_unfused_attention_also_saves_the_score_matrix(llama):
    fused = footprint(compile_step(llama)).activations
    unfused = footprint(compile_step(llama, fused_attention=False)).activations
    assert sympy.expand(unfused - fused - L * 2 * B * H * S**2) == 0


def test_a_small_graph_saves_exactly_what_its_backward_reads():
    g = GraphBuilder("small", {B: 2, S: 16, D: 32, F: 64, V: 100})
    tokens, targets = g.input("tokens", (B, S)), g.input("targets", (B, S))
    x = g.embedding(tokens, g.weight("embed", (V, D)))
    a = g.gelu(g.matmul(x, g.weight("up", (D, F)), name="up"))
    logits = g.matmul(a, g.weight("down", (F, V)), name="down")
    g.cross_entropy(logits, targets)
    fp = footprint(compile_step(g.build()))
    # matmul inputs x and a, GELU's input, the logits; the token ids and the targets (INT32)
    expected = 2 * B * S * D + 2 * B * S * F + 2 * B * S * F + 2 * B * S * V + 2 * 4 * B * S
    assert sympy.expand(fp.activations - expected) == 0
    assert footprint(g.graph).total == 2 * (V * D + D * F + F * V)  # a forward graph: weights


def test_optimizer_states_follow_the_adamw_precisions(llama):
    plain = attach_adamw(derive_backward(llama), AdamW(master=None, copy=None, zero_grad=False))
    assert sympy.expand(footprint(plain).optimizer - 8 * llama.parameters()) == 0


def test_the_plates_step_does_not_fit_an_80gb_h100(llama_step):
    memory = evaluate(llama_step, H100).memory
    n = 8_030_261_248
    assert memory.weights + memory.gradients + memory.optimizer == n * (2 + 4 + 12)
    assert memory.total == memory.weights + memory.gradients + memory.optimizer + \
        memory.activations + memory.transient
    # the peak is the loss's backward: every layer's saved activations, and the logits'
    # gradient [B, S, V] in BF16 beside the FP32 loss seed
    assert (memory.op, memory.phase) == ("loss.grad", "backward")
    assert memory.transient == 2 * 8192 * 128256 + 4
    saved = footprint(llama_step).activations.xreplace(resolve(llama_step))
    assert memory.activations == saved
    assert memory.capacity == 80e9 and memory.fits is False
    assert memory.to_json()["total"] == memory.total


def test_profile_warns_but_does_not_refuse(cli):
    code, out, err = cli("profile")
    assert code == 0
    assert "\nmemory " in out and "of 80.00 GB" in out and "OVER CAPACITY" in out
    assert err.count("\n") == 1 and err.startswith("opgraph: warning: ") and "80.00 GB" in err
    code, out, err = cli("profile", "--json")
    assert code == 0 and err == ""  # with --json the warning is in the object: stderr stays clean
    j = json.loads(out)
    assert len(j["warnings"]) == 1 and "80.00 GB" in j["warnings"][0]
    memory = j["memory"]
    assert set(memory) == {"weights", "gradients", "optimizer", "activations", "transient",
                           "buffers", "total", "allocated", "capacity", "fits", "peak_op",
                           "peak_phase"}
    assert memory["fits"] is False and memory["total"] > 144.5e9
    # one GPU gathers nothing: what is reserved is what is allocated
    assert memory["buffers"] == 0 and memory["total"] == memory["allocated"]


def test_no_warning_when_it_fits(cli):
    code, out, err = cli("profile", "--model", "gpt2", "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["memory"]["fits"] is True and json.loads(out)["warnings"] == []


def test_a_part_without_a_capacity(cli, tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text("[gpu]\nbf16_tflops = 100\nbandwidth_tbs = 1\n")
    code, out, err = cli("profile", "--hardware", str(path))
    assert code == 0 and err == "" and "capacity unknown" in out


# --- the peak, by liveness over the execution order ------------------------------------------

def _stack():
    """x -> L x (matmul, GELU) -> head -> loss: one region, one carried tensor."""
    g = GraphBuilder("stack", {B: 2, S: 16, D: 32, V: 100, L: 4})
    x = g.activation("x", (B, S, D))
    targets = g.input("targets", (B, S))
    with g.repeat(L, "layers"):
        x = g.gelu(g.matmul(x, g.weight("w", (D, D)), name="mm"), name="act")
    g.cross_entropy(g.matmul(x, g.weight("w_head", (D, V)), name="head"), targets, name="loss")
    return compile_step(g.build())


def test_a_layers_saved_tensors_count_every_layer_but_its_own_before_it_is_made():
    from opgraph.cost.memory import liveness

    step = _stack()
    live = liveness(step)
    at = {op.name: i for i, op in enumerate(live.ops)}
    x, ids = 2 * B * S * D, 4 * B * S  # the stack's input (BF16) and the targets (INT32)
    # while the last layer's matmul runs: all L of its outputs (this one being written) but
    # only the L - 1 GELU outputs the earlier layers made
    first = live.moment(at["layers.mm"])
    assert sympy.expand(first.activations - (L * x + (L - 1) * x + x + ids)) == 0
    # while the first layer's GELU backward runs (the last layer's): every matmul output, and
    # the GELU outputs of the other layers (the head's backward read this one's already); the
    # targets are gone, the loss's backward was their last reader
    back = live.moment(at["layers.act.grad"])
    assert sympy.expand(back.activations - (L * x + (L - 1) * x + x)) == 0
    # the loss's backward: everything the forward saved
    head = live.moment(at["loss.grad"])
    assert sympy.expand(head.activations - footprint(step).activations) == 0


def test_the_peak_is_the_footprint_plus_the_logits_gradient(llama_step):
    from opgraph.passes.evaluate import resolve

    from opgraph.cost.memory import peak

    moment = peak(llama_step, resolve(llama_step))
    assert moment.op == "loss.grad"
    fp = footprint(llama_step)
    assert sympy.expand(moment.activations - fp.activations) == 0
    seed = llama_step.tensor("d.loss").nbytes  # dLoss/dLoss, one number
    assert sympy.expand(moment.transient - 2 * B * S * V - seed) == 0
    assert sympy.expand(moment.total - fp.total - moment.transient) == 0


def test_peak_memory_falls_with_recomputation(llama):
    totals = [evaluate(compile_step(llama, recompute=p), H100).memory
              for p in ("none", "selective", "full")]
    assert totals[0].activations > totals[1].activations > totals[2].activations
    assert totals[0].total > totals[1].total > totals[2].total
    assert totals[2].fits is False  # 8B on one 80 GB part needs sharding regardless


def test_the_profile_says_where_the_peak_happens(cli):
    code, out, _err = cli("profile", "--json")
    memory = json.loads(out)["memory"]
    assert code == 0 and (memory["peak_op"], memory["peak_phase"]) == ("loss.grad", "backward")
    code, out, _err = cli("profile")
    assert code == 0 and "OVER CAPACITY at loss.grad (" in out


def test_just_over_capacity_does_not_read_as_equal(cli):
    """Gemma 2 2B at 8,192 tokens needs a few hundred kB over 80 GB: the figures must differ."""
    code, out, err = cli("profile", "--model", "gemma2-2b")
    line = next(ln for ln in out.splitlines() if ln.startswith("memory"))
    need, _, rest = line.removeprefix("memory").strip().partition(" of ")
    assert code == 0 and "OVER CAPACITY" in line and need != rest.split(":")[0]
    assert "80.00 GB of HBM, more than the 80.00 GB" not in err


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_copy_matrices_are_copies(recompute):
    """`Liveness.copy_matrices` (the search's memory, as arrays) says what `copies` says at
    every op and life: one + many x count, for a count standing for the layers."""
    from opgraph.cost.memory import liveness

    live = liveness(compile_step(preset("llama3.2-1b"), recompute=recompute))
    one, many = live.copy_matrices()
    count = 1000
    for i in range(len(live.ops)):
        for j, life in enumerate(live.lives):
            assert int(one[i, j]) + int(many[i, j]) * count == live.copies(life, i, count), (
                i, j)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_partial_gradient_and_the_sum_written_into_it_are_one_buffer(zero):
    """GPT-2 ties its embedding to the head: the head's weight gradient is the first partial,
    and the embedding's backward accumulates into it, writing the sum in that buffer. Where
    the full gradient is not the resident buffer (plain data parallelism before its
    all-reduce, ZeRO-2/3 before the reduce-scatter) it is one transient: one V x D x 4 bytes
    while the embedding's backward runs, not the partial and the sum side by side."""
    from opgraph.parallel.distributed import compile_parallel
    from opgraph.cost.memory import liveness
    from opgraph.models import gpt2
    from opgraph.parallel.parallel import Parallel

    config = gpt2.GPT2Config("tiny", d_model=32, layers=2, heads=2, vocab=96, positions=16)
    step = compile_parallel(gpt2.build(config), Parallel(dp=2, zero=zero))
    live = liveness(step)
    at = [op.name for op in live.ops].index("wte.grad")
    assert step.op("wte.grad").param("accumulate") == 1
    subs = resolve(step)
    full = [life.tensor.name for life in live.lives if live.copies(life, at)
            and life.tensor.nbytes.xreplace(subs) == 96 * 32 * 4]
    assert len(full) == 1, full


def test_a_views_backward_keeps_no_tensor_it_reads_for_its_shape():
    """A reshape's backward needs its input's sizes, not its data (PyTorch's view backward keeps
    the sizes): Qwen3's per-head query norm reads Q through a reshape, so the memory model keeps
    the reshaped view the norm's backward reads, one copy of B S H d_h, and not Q itself beside
    it, where both were counted."""
    import attrs

    from opgraph.cost.memory import saved
    from opgraph.models import llama

    step = compile_step(llama.build(attrs.evolve(llama.LLAMA3_8B, name="qk", qk_norm=True)))
    kept = {t.name for t in saved(step)}
    assert "layers.q_norm.heads" in kept and "layers.q_proj" not in kept
    assert "layers.k_norm.heads" in kept and "layers.k_proj" not in kept
    reader = {o.kind for o in step.consumers("layers.q_proj") if o.phase.value == "backward"}
    assert reader == {"reshape_backward"}  # still read there, for its shape
