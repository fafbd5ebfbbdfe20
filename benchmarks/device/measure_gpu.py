"""Measure what the calibrated cost model assumes, on a real GPU, in one short run.

Run on a machine with one NVIDIA GPU and PyTorch (and, for the training-step traces,
Hugging Face transformers); nothing here is imported by opgraph:

    python benchmarks/device/measure_gpu.py OUTDIR [--quick] [--only=SECTION,...]

It writes OUTDIR/results.json (the part, its clocks and power limit, then one table per
section) and OUTDIR/trace_<model>.json.gz (PyTorch profiler traces of real training steps, which
`opgraph trace-breakdown` and `opgraph compare` read). Sections, each timed with CUDA events
(median of trials, after warm-up, on random data: zeros run faster):

- gemm: BF16 matrix products of the shapes training steps run (Llama 3 8B and 70B linears and
  head at tensor-parallel 1-8, forward, input-gradient and weight-gradient orientations, as
  nn.Linear's autograd issues them), square sizes, and an N sweep at M = K = 8192 for the waves.
- fp8: torch._scaled_mm (tensor-wise scales) on the 8B linears.
- memory: achieved HBM bandwidth of copy, add, mul, SiLU over sizes from 1 MB to 4 GB; the gap
  between back-to-back small kernels on the GPU and the host's time per eager launch.
- adamw: torch.optim.AdamW(fused=True) and (foreach=True) over 1 B parameters, bytes per parameter.
- attention: scaled_dot_product_attention, causal, 32 heads (16 at head dim 256) with K and V
  expanded to them as Hugging Face's SDPA path does, forward and forward+backward, by backend
  (flash, cuDNN), head dim and sequence length.
- steps: Hugging Face LlamaForCausalLM (random weights, BF16 parameters, fused AdamW with BF16
  states, SDPA attention), Llama 3.2 1B and Llama 3 8B shapes on 1 x 8,192 tokens: step time,
  peak memory, and a 2-step profiler trace each.

Two more sections run when `--only` names them:

- gemm_clock: the training shapes at 8,192 tokens, squares and the N sweep in a shuffled order
  after 8 s of heating, each with the SM clock and board power NVML reads while it runs, so
  that a shape's efficiency can be read per clock cycle, apart from the power limit.
- gpt: a GPT-2-style model (MHA, GELU, learned positions, dropout 0.1, vocabulary 50,257; and
  again with 50,304) and a Llama-style one, both 4,096 wide and 16 layers deep, on 4 x 2,048
  tokens, each traced.
- attention_long: causal attention at head dim 128 on 8 heads, one sequence of 8,192 to
  262,144 tokens, and the two kernels of a ring step at CP 8 of 262,144 tokens, by backend,
  timed sustained after heating with the SM clock and board power: the rates long-context runs
  take, which the attention section's 32,768 tokens do not reach.
- steps2: variants of the steps: the 8B with FlashAttention-2 forced, the 8B with every layer
  checkpointed, the 1B with FP32 parameters and AdamW states under BF16 autocast, and the 1B
  through torch.compile.
"""
import gc
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
QUICK = "--quick" in sys.argv
DEFAULT = ("gemm", "fp8", "memory", "adamw", "attention", "steps")
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), DEFAULT)
RESULTS: dict = {}
T0 = time.time()


def log(*args):
    print(f"[{time.time() - T0:7.1f}s]", *args, flush=True)


def save():
    tmp = os.path.join(OUT, "results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(RESULTS, f, indent=1)
    os.replace(tmp, os.path.join(OUT, "results.json"))


def smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - a reading, not a requirement
        return f"unavailable: {e}"


def one_call(fn, warmup=3):
    """Seconds one call of fn takes after `warmup` calls, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def timed(fn, warmup=3, reps=10, trials=3, budget_s=0.5):
    """Median seconds per call of fn over `trials` event-timed loops of `reps` calls."""
    one = one_call(fn, warmup)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(1, min(reps, int(budget_s / max(one, 1e-7) / trials)))
    out = []
    for _ in range(trials):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(out)


def section(name):
    def wrap(body):
        if name not in ONLY:
            return body
        log(f"== {name}")
        t = time.time()
        try:
            body()
        except Exception:  # noqa: BLE001 - keep the other sections
            RESULTS.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            log(f"{name} FAILED:\n{traceback.format_exc()[-1500:]}")
        RESULTS.setdefault("section_s", {})[name] = round(time.time() - t, 1)
        save()
        gc.collect()
        torch.cuda.empty_cache()
        return body
    return wrap


def heat(seconds: float) -> None:
    """Run large BF16 products for `seconds`, so that what follows is timed at the clock and
    power a sustained load settles to, not a cold burst's."""
    a, b = rand(8192, 8192), rand(8192, 8192)
    w = time.time()
    while time.time() - w < seconds:
        for _ in range(20):
            torch.matmul(a, b)
        torch.cuda.synchronize()


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).mul_(0.05).to(dtype)


# ---------------------------------------------------------------------------------- device
props = torch.cuda.get_device_properties(0)
RESULTS["device"] = {
    "name": props.name, "sms": props.multi_processor_count,
    "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
    "l2_bytes": getattr(props, "L2_cache_size", None),
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
    "date": time.strftime("%Y-%m-%d", time.gmtime()),
    "smi_clocks_power": smi("name,driver_version,clocks.max.sm,clocks.max.mem,"
                            "power.limit,power.default_limit,power.max_limit,enforced.power.limit"),
}
log(RESULTS["device"])
save()


# ------------------------------------------------------------------------------------ gemm
@section("gemm")
def _gemm():
    rows = RESULTS["gemm"] = []
    linears = {  # name: (in, out) of nn.Linear, before tensor parallelism
        "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672),
        "8b.down": (14336, 4096), "8b.head": (4096, 128256),
        "70b.qkv": (8192, 10240), "70b.o": (8192, 8192), "70b.gate_up": (8192, 57344),
        "70b.down": (28672, 8192),
    }
    tokens = (1024, 4096, 8192, 16384) if not QUICK else (4096,)
    tps = (1, 2, 4, 8) if not QUICK else (1, 8)
    shapes = []
    for name, (din, dout) in linears.items():
        for tp in tps:
            # column-parallel splits out, row-parallel (o, down) splits in; the head is column.
            row = name.endswith((".o", ".down"))
            i, o = (din // tp, dout) if row else (din, dout // tp)
            for t in tokens:
                shapes.append((f"{name}.tp{tp}", "fwd", t, o, i))      # y = x W^T: M=t N=o K=i
                shapes.append((f"{name}.tp{tp}", "dgrad", t, i, o))    # dx = dy W:  M=t N=i K=o
                shapes.append((f"{name}.tp{tp}", "wgrad", o, i, t))    # dW = dy^T x: M=o N=i K=t
    for n in (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384):
        shapes.append(("square", "fwd", n, n, n))
    for n in range(256, 8192 + 1, 256 if not QUICK else 1024):
        shapes.append(("nsweep", "fwd", 8192, n, 8192))
    cache = {}

    def tensor(shape):
        if shape not in cache:
            if sum(t.numel() for t in cache.values()) * 2 > 30e9:
                cache.clear()
            cache[shape] = rand(*shape)
        return cache[shape]

    deadline = time.time() + (150 if not QUICK else 30)
    for label, orient, m, n, k in shapes:
        if time.time() > deadline:
            RESULTS.setdefault("skipped", []).append(f"gemm after {label} {orient}: time budget")
            break
        if orient == "fwd":        # x [M,K] @ W[N,K]^T  (nn.Linear forward)
            a, b = tensor((m, k)), tensor((n, k))
            fn = lambda a=a, b=b: torch.matmul(a, b.t())  # noqa: E731
        elif orient == "dgrad":    # dy [M,K] @ W [K,N]
            a, b = tensor((m, k)), tensor((k, n))
            fn = lambda a=a, b=b: torch.matmul(a, b)  # noqa: E731
        else:                      # dy^T [M,K] @ x [K,N] with dy stored [K,M]
            a, b = tensor((k, m)), tensor((k, n))
            fn = lambda a=a, b=b: torch.matmul(a.t(), b)  # noqa: E731
        s = timed(fn, budget_s=0.15)
        rows.append({"label": label, "orient": orient, "M": m, "N": n, "K": k,
                     "seconds": s, "tflops": 2 * m * n * k / s / 1e12})
    cache.clear()
    RESULTS["gemm_smi_after"] = smi("clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                                    "clocks_throttle_reasons.active")
    best = max(rows, key=lambda r: r["tflops"])
    log(f"{len(rows)} GEMMs; best {best['tflops']:.0f} TFLOP/s at "
        f"{best['M']}x{best['N']}x{best['K']}")


# ------------------------------------------------------------------------------------- fp8
@section("fp8")
def _fp8():
    rows = RESULTS["fp8"] = []
    one = torch.ones((), device="cuda", dtype=torch.float32)
    for m, n, k in [(8192, 6144, 4096), (8192, 4096, 4096), (8192, 28672, 4096),
                    (8192, 4096, 14336), (8192, 8192, 8192), (4096, 4096, 4096),
                    (16384, 16384, 16384), (2048, 4096, 4096)]:
        a = rand(m, k).to(torch.float8_e4m3fn)
        b = rand(n, k).to(torch.float8_e4m3fn).t()  # column-major [K, N], as _scaled_mm wants
        for fast in (False, True):
            fn = lambda a=a, b=b, fast=fast: torch._scaled_mm(  # noqa: E731
                a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
            s = timed(fn, budget_s=0.15)
            rows.append({"M": m, "N": n, "K": k, "fast_accum": fast, "seconds": s,
                         "tflops": 2 * m * n * k / s / 1e12})
    log("fp8 best", max(r["tflops"] for r in rows))


# ---------------------------------------------------------------------------------- memory
@section("memory")
def _memory():
    rows = RESULTS["memory"] = []
    sizes = [2 ** p for p in range(20, 33, 1 if not QUICK else 3)]  # bytes per operand, bf16
    for nbytes in sizes:
        n = nbytes // 2
        x, y = rand(n), rand(n)
        z = torch.empty_like(x)
        kernels = {
            "copy": (lambda: z.copy_(x), 2),
            "add": (lambda: torch.add(x, y, out=z), 3),
            "mul": (lambda: torch.mul(x, y, out=z), 3),
            "silu": (lambda: torch.nn.functional.silu(x), 2),
        }
        for name, (fn, passes) in kernels.items():
            s = timed(fn, budget_s=0.1)
            rows.append({"kernel": name, "bytes_per_operand": nbytes,
                         "bytes_moved": passes * nbytes,
                         "seconds": s, "tbs": passes * nbytes / s / 1e12})
        del x, y, z
    # Back-to-back tiny kernels: the GPU-side gap per kernel (launches queued ahead).
    t = rand(256)
    s = timed(lambda: [t.add_(1e-3) for _ in range(1000)], warmup=2, reps=3, budget_s=2)
    RESULTS["tiny_kernel_gpu_s"] = s / 1000
    # Host time per eager op: wall clock over 20,000 tiny adds, synchronised at the end.
    torch.cuda.synchronize()
    w = time.perf_counter()
    for _ in range(20000):
        t.add_(1e-3)
    host = (time.perf_counter() - w) / 20000
    torch.cuda.synchronize()
    RESULTS["eager_host_per_op_s"] = host
    # The same through a CUDA graph: launch gap without the host.
    try:
        g = torch.cuda.CUDAGraph()
        s_ = torch.cuda.Stream()
        s_.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s_):
            for _ in range(3):
                t.add_(1e-3)
        torch.cuda.current_stream().wait_stream(s_)
        with torch.cuda.graph(g):
            for _ in range(1000):
                t.add_(1e-3)
        RESULTS["tiny_kernel_graph_s"] = timed(g.replay, warmup=2, reps=3, budget_s=1) / 1000
    except Exception as e:  # noqa: BLE001
        RESULTS["tiny_kernel_graph_s"] = f"failed: {e}"
    big = [r for r in rows if r["bytes_per_operand"] == sizes[-1]]
    log("HBM at", sizes[-1] >> 20, "MiB:", {r["kernel"]: round(r["tbs"], 2) for r in big},
        "tiny gpu us", round(RESULTS["tiny_kernel_gpu_s"] * 1e6, 2),
        "host us", round(host * 1e6, 2))


# ----------------------------------------------------------------------------------- adamw
@section("adamw")
def _adamw():
    rows = RESULTS["adamw"] = []
    total = 1_000_000_000 if not QUICK else 200_000_000
    # 8B-like tensors: 4096x4096-sized pieces (16.8 M params each) plus some small ones.
    for dtype in (torch.bfloat16, torch.float32):
        for impl in ("fused", "foreach"):
            params = []
            left = total
            while left > 0:
                n = min(16_777_216, left)
                p = torch.nn.Parameter(rand(n, dtype=dtype))
                p.grad = rand(n, dtype=dtype)
                params.append(p)
                left -= n
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **{impl: True})
            s = timed(opt.step, warmup=2, reps=3, trials=3, budget_s=3)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "impl": impl,
                         "params": total, "tensors": len(params), "seconds": s})
            del opt, params
            gc.collect()
            torch.cuda.empty_cache()
    log({f"{r['dtype']}/{r['impl']}": f"{r['seconds'] * 1e3:.1f} ms" for r in rows})


# ------------------------------------------------------------------------------- attention
@section("attention")
def _attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = RESULTS["attention"] = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    tokens = 32768
    seqs = (1024, 2048, 4096, 8192, 16384, 32768) if not QUICK else (8192,)
    for bname, backend in backends.items():
        for d in (64, 128, 256):
            hq = 32 if d != 256 else 16
            for s in seqs:
                b = max(1, tokens // s)
                q = rand(b, hq, s, d).requires_grad_()
                k = rand(b, hq, s, d).requires_grad_()
                v = rand(b, hq, s, d).requires_grad_()
                dout = rand(b, hq, s, d)
                flops = 4 * b * hq * s * s * d / 2  # causal half, QK^T and P.V
                try:
                    with sdpa_kernel(backend):
                        fwd = lambda: F.scaled_dot_product_attention(  # noqa: E731
                            q, k, v, is_causal=True)
                        tf = timed(fwd, budget_s=0.2)

                        def both():
                            torch.autograd.grad(fwd(), (q, k, v), dout)
                        tb = timed(both, budget_s=0.3)
                    rows.append({"backend": bname, "head_dim": d, "heads": hq,
                                 "batch": b, "seq": s, "fwd_s": tf, "fwd_bwd_s": tb,
                                 "fwd_tflops": flops / tf / 1e12,
                                 "bwd_tflops": 2.5 * flops / (tb - tf) / 1e12})
                except Exception as e:  # noqa: BLE001 - a backend may refuse a shape
                    rows.append({"backend": bname, "head_dim": d, "seq": s, "error": str(e)[:200]})
                del q, k, v, dout
                q = k = v = None
    ok = [r for r in rows if "fwd_s" in r]
    for r in ok:
        if r["seq"] == 8192:
            log(f"{r['backend']} d{r['head_dim']} s8192: fwd {r['fwd_tflops']:.0f} "
                f"bwd {r['bwd_tflops']:.0f} TFLOP/s")


# ----------------------------------------------------------------------------------- steps
def llama_step(name, cfg, seq, steps_timed=5, attention=None, checkpoint=False,
               master_fp32=False, compile_model=False, trace=True, arch="llama", batch=1):
    """One Hugging Face training step of a Llama (or, `arch` "gpt2", a GPT-2-style model):
    BF16 parameters and fused AdamW with BF16 states, or (`master_fp32`) FP32 parameters and
    states under BF16 autocast; `attention` forces an SDPA backend ("flash", "cudnn");
    `checkpoint` re-runs each layer in the backward; `batch` sequences of `seq` tokens."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    if arch == "gpt2":
        from transformers import GPT2Config as LlamaConfig
        from transformers import GPT2LMHeadModel as LlamaForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**cfg, use_cache=False)
    try:
        config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001
        pass
    torch.set_default_dtype(torch.float32 if master_fp32 else torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.train()
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=True)
    forward = torch.compile(model) if compile_model else model
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device="cuda")
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

    def step():
        with contextlib.ExitStack() as stack:
            if attention:
                stack.enter_context(sdpa_kernel(backend[attention]))
            if master_fp32:
                stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps_timed):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    record = {"model": name, "arch": arch, "config": cfg, "params": params, "seq": seq,
              "tokens": batch * seq, "batch": batch,
              "attn": getattr(config, "_attn_implementation", None), "attention_backend":
              attention or "default", "checkpoint": checkpoint, "compiled": compile_model,
              "param_dtype": "float32 (bf16 autocast)" if master_fp32 else "bfloat16",
              "optimizer": "AdamW fused, " + ("fp32 states" if master_fp32 else "bf16 states"),
              "step_s": times, "step_median_s": statistics.median(times),
              "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
              "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    tag = name + "".join(f"-{k}" for k, v in (("flash", attention == "flash"),
                                              ("cudnn", attention == "cudnn"),
                                              ("ckpt", checkpoint), ("fp32master", master_fp32),
                                              ("compiled", compile_model)) if v)
    record["tag"] = tag
    if trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        raw = os.path.join("/tmp", f"trace_{tag}.json")
        prof.export_chrome_trace(raw)
        gz = os.path.join(OUT, f"trace_{tag}.json.gz")
        with open(raw, "rb") as f, gzip.open(gz, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        if os.path.getsize(gz) > 15 * 2 ** 20:  # over what comes back: keep the GPU events
            with open(raw) as f:
                doc = json.load(f)
            keep = [e for e in doc.get("traceEvents", []) if e.get("ph") == "M" or
                    e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
            doc["traceEvents"] = keep
            with gzip.open(gz, "wt", compresslevel=9) as g:
                json.dump(doc, g)
            record["trace_note"] = "CPU events dropped to fit the transfer"
        record["trace_bytes_gz"] = os.path.getsize(gz)
        os.remove(raw)
        del prof
    del model, opt, forward
    return record


LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, max_position_embeddings=131072)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, max_position_embeddings=8192)


def one_step(rows, name, cfg, seqs=(8192,), **options):
    """`llama_step` at the first of `seqs` that fits in memory, its record (or its error) in
    `rows`, a line in the log, the results saved and the memory freed."""
    try:
        r, oom = None, []
        for seq in seqs:
            try:
                r = llama_step(name, cfg, seq, **options)
                break
            except torch.OutOfMemoryError:
                oom.append(f"out of memory at {seq} tokens")
            gc.collect()
            torch.cuda.empty_cache()
        if r is None:
            raise RuntimeError("; ".join(oom))
        r["oom"] = oom
        rows.append(r)
        log(f"{r['tag']}: {r['tokens']} tokens, step {r['step_median_s'] * 1e3:.1f} ms, peak "
            f"{r['peak_allocated_bytes'] / 1e9:.1f} GB, {r['params']:,} parameters")
    except Exception:  # noqa: BLE001
        rows.append({"model": name, "options": str(options),
                     "error": traceback.format_exc()[-1500:]})
        log(f"{name} {options} FAILED:\n{traceback.format_exc()[-1500:]}")
    save()
    gc.collect()
    torch.cuda.empty_cache()


@section("steps")
def _steps():
    rows = RESULTS["steps"] = []
    for name, cfg in (("llama3.2-1b", LLAMA32_1B), ("llama3-8b", LLAMA3_8B)):
        if not (QUICK and name != "llama3.2-1b"):
            one_step(rows, name, cfg, seqs=(8192, 4096))  # 4,096 where 8,192 does not fit


# ----------------------------------------------------------------------------- gemm_clock
@section("gemm_clock")
def _gemm_clock():
    import random

    import pynvml
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    rows = RESULTS["gemm_clock"] = []
    linears = {"8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672),
               "8b.down": (14336, 4096), "8b.head": (4096, 128256),
               "70b.qkv": (8192, 10240), "70b.o": (8192, 8192), "70b.gate_up": (8192, 57344),
               "70b.down": (28672, 8192)}
    shapes = []
    for name, (din, dout) in linears.items():
        for tp in (1, 2, 4, 8):
            row = name.endswith((".o", ".down"))
            i, o = (din // tp, dout) if row else (din, dout // tp)
            t = 8192
            shapes += [(f"{name}.tp{tp}", "fwd", t, o, i), (f"{name}.tp{tp}", "dgrad", t, i, o),
                       (f"{name}.tp{tp}", "wgrad", o, i, t)]
    shapes += [("square", "fwd", n, n, n) for n in (1024, 2048, 4096, 6144, 8192, 12288, 16384)]
    shapes += [("nsweep", "fwd", 8192, n, 8192) for n in range(512, 8192 + 1, 512)]
    shapes += [("ksweep", "fwd", 8192, 8192, k) for k in (256, 512, 1024, 2048, 4096, 16384)]
    shapes += [("msweep", "fwd", m, 4096, 4096) for m in (128, 256, 512, 1024, 2048, 4096)]
    random.Random(0).shuffle(shapes)
    heat(8)
    deadline = time.time() + (90 if not QUICK else 15)
    for label, orient, m, n, k in shapes:
        if time.time() > deadline:
            RESULTS.setdefault("skipped", []).append(f"gemm_clock after {label}: time budget")
            break
        if orient == "wgrad":
            x, y = rand(k, m), rand(k, n)
            fn = lambda x=x, y=y: torch.matmul(x.t(), y)  # noqa: E731
        elif orient == "dgrad":
            x, y = rand(m, k), rand(k, n)
            fn = lambda x=x, y=y: torch.matmul(x, y)  # noqa: E731
        else:
            x, y = rand(m, k), rand(n, k)
            fn = lambda x=x, y=y: torch.matmul(x, y.t())  # noqa: E731
        one = one_call(fn)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = max(3, min(200, int(0.12 / max(one, 1e-7))))
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        time.sleep(min(0.05, one * reps / 2))  # read the clock while the products run
        clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3
        torch.cuda.synchronize()
        sec = e0.elapsed_time(e1) / 1e3 / reps
        rows.append({"label": label, "orient": orient, "M": m, "N": n, "K": k, "seconds": sec,
                     "tflops": 2 * m * n * k / sec / 1e12, "sm_mhz": clock, "power_w": power,
                     "reps": reps})
        del x, y
    log(f"{len(rows)} GEMMs with clocks; SM MHz {min(r['sm_mhz'] for r in rows)}-"
        f"{max(r['sm_mhz'] for r in rows)}")


# ------------------------------------------------------------------------------------- gpt
# A GPT-style and a Llama-style model of the same width, depth and tokens: does one GPU run
# their GEMMs at different rates? (docs/calibration.md, "Two camps".)
GPT_4096_16L = dict(vocab_size=50257, n_embd=4096, n_layer=16, n_head=32, n_positions=2048)
LLAMA_4096_16L = dict(LLAMA3_8B, num_hidden_layers=16, max_position_embeddings=2048)


@section("gpt")
def _gpt():
    rows = RESULTS["gpt"] = []
    one_step(rows, "gpt-4096-16l", GPT_4096_16L, seqs=(2048,), arch="gpt2", batch=4)
    # the control: the same model with its vocabulary padded to a multiple of 64, as nanoGPT does
    one_step(rows, "gpt-4096-16l-v50304", dict(GPT_4096_16L, vocab_size=50304), seqs=(2048,),
             arch="gpt2", batch=4)
    one_step(rows, "llama-4096-16l", LLAMA_4096_16L, seqs=(2048,), arch="llama", batch=4)


# ---------------------------------------------------------------------------------- steps2
@section("steps2")
def _steps2():
    rows = RESULTS["steps2"] = []
    variants = [("llama3-8b", LLAMA3_8B, dict(attention="flash")),
                ("llama3-8b", LLAMA3_8B, dict(checkpoint=True)),
                ("llama3.2-1b", LLAMA32_1B, dict(master_fp32=True)),
                ("llama3.2-1b", LLAMA32_1B, dict(compile_model=True))]
    for name, cfg, options in variants:
        if time.time() - T0 > 330:
            RESULTS.setdefault("skipped", []).append(f"steps2 {name} {options}: time budget")
        else:
            one_step(rows, name, cfg, **options)


# -------------------------------------------------------------------------- attention_long
@section("attention_long")
def _attention_long():
    """Attention as long-context runs take it, sustained: head dim 128, 8 heads (a 32-head
    model at TP 4), one sequence; each kernel timed over about a second of back-to-back calls
    after 8 s of heating, with the SM clock and board power read meanwhile. "causal" rows: a
    whole sequence, 8,192 to 262,144 tokens; "ring" rows: the two kernels of a load-balanced
    causal ring step at CP 8 of 262,144 tokens (the diagonal: a causal 32,768-token chunk; off
    it: 16,384 queries over 32,768 keys, no mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 - the times without the clock
        pynvml = handle = None
    rows = RESULTS["attention_long"] = []
    heads, d = 8, 128
    shapes = [("causal", s, s, True) for s in (8192, 32768, 65536, 131072, 262144)]
    shapes += [("ring", 32768, 32768, True), ("ring", 16384, 32768, False)]
    if QUICK:
        shapes = shapes[:2]
    heat(8)
    for bname, backend in {"flash": SDPBackend.FLASH_ATTENTION,
                           "cudnn": SDPBackend.CUDNN_ATTENTION}.items():
        for kind, sq, skv, causal in shapes:
            q = rand(1, heads, sq, d).requires_grad_()
            k = rand(1, heads, skv, d).requires_grad_()
            v = rand(1, heads, skv, d).requires_grad_()
            dout = rand(1, heads, sq, d)
            # QK^T and P.V; a causal square counts its lower half
            flops = 4 * heads * sq * skv * d / (2 if causal else 1)
            row = {"kind": kind, "backend": bname, "head_dim": d, "heads": heads, "batch": 1,
                   "seq": sq, "seq_kv": skv, "causal": causal}
            try:
                with sdpa_kernel(backend):
                    def fwd(q=q, k=k, v=v, causal=causal):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def both(fwd=fwd, q=q, k=k, v=v, dout=dout):
                        torch.autograd.grad(fwd(), (q, k, v), dout)
                    tf = timed(fwd, trials=3, budget_s=1.0)
                    tb = timed(both, trials=3, budget_s=1.0)
                    if handle is not None:  # the clock while it runs
                        for _ in range(3):
                            both()
                        row["sm_mhz"] = pynvml.nvmlDeviceGetClockInfo(handle,
                                                                      pynvml.NVML_CLOCK_SM)
                        row["power_w"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3
                        torch.cuda.synchronize()
                row.update(fwd_s=tf, fwd_bwd_s=tb, fwd_tflops=flops / tf / 1e12,
                           bwd_tflops=2.5 * flops / (tb - tf) / 1e12)
            except Exception as e:  # noqa: BLE001 - a backend may refuse a shape
                row["error"] = str(e)[:200]
            rows.append(row)
            q = k = v = dout = fwd = None
            gc.collect()
            torch.cuda.empty_cache()
    for r in rows:
        if "fwd_s" in r:
            log(f"{r['backend']} {r['kind']} {r['seq']}x{r['seq_kv']}: fwd {r['fwd_tflops']:.0f} "
                f"bwd {r['bwd_tflops']:.0f} TFLOP/s at {r.get('sm_mhz', '?')} MHz")


RESULTS["total_s"] = round(time.time() - T0, 1)
save()
log("done")
