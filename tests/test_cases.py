"""Validation cases as data (issue 12's case file): the shipped set against its published sources,
the conversions re-derived from ../shared/validation/dev.json by the papers' own formulas, every
kind of bad input as one line, and every case's model against its published parameter count."""

import copy
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from opgraph.io import cases as cases_module
from opgraph.io.cases import Case, load_cases
from opgraph.core.errors import OpgraphError
from opgraph.parallel.parallel import stage_layers
from opgraph.core.symbols import D, F, H, H_kv, L, S, V
from opgraph.core.verify import verify

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped() -> list[Case]:
    return load_cases()


@pytest.fixture(scope="module")
def by_id(shipped) -> dict[str, Case]:
    return {c.id: c for c in shipped}


def narayanan_flops(B, s, l, h, V):
    """FLOPs of one iteration, Narayanan et al. 2021 (SC21, arXiv 2104.04473) Eq. 3: with full
    recomputation, 4 passes of 24 B s l h^2 (1 + s/(6h)) plus the LM head's 6 B s h V."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


# --- the shipped file ---------------------------------------------------------------------------
FAMILIES = {"korthikanti22_tab5": 8, "narayanan21_tab1": 10, "narayanan21_tab2": 12,
            "megatron_core_h100": 9, "torchtitan_h100": 3, "simumax_b200": 24,
            "ultrascale_playbook": 14}


def test_the_shipped_file_loads_80_cases_of_seven_families(shipped):
    assert len(shipped) == 80
    assert len({c.id for c in shipped}) == 80
    families = [c.family for c in shipped]
    assert {f: families.count(f) for f in FAMILIES} == FAMILIES
    for c in shipped:
        assert c.source and c.notes and c.id.startswith(c.family.split("_")[0])
        assert c.gpus == c.parallel.world  # tp x cp x pp x dp
        assert c.parallel.batch % (c.parallel.dp_degree * c.parallel.micro_batch) == 0
        assert c.parallel.framework in ("megatron", "deepspeed-0.3", "torchtitan-2024",
                                        "nanotron")


def test_each_run_names_the_framework_its_source_ran():
    """The framework decides passes (gradient dtype, regathers, when reductions run), so each
    case names the one its source used: the Ultrascale Playbook ran nanotron, Narayanan et al.
    Table 2's ZeRO-3 rows DeepSpeed of early 2021 (its v0.3 ZeRO-3), torchtitan's December 2024
    table torchtitan as it was then (its loss uncompiled: torchtitan-2024), every other family Megatron-LM (Megatron-Core's table, SimuMax's B200 runs and
    the two Megatron papers)."""
    expected = {"ultrascale_playbook": "nanotron", "torchtitan_h100": "torchtitan-2024"}
    for c in cases_module.load_cases(cases_module.SHIPPED):
        want = ("deepspeed-0.3" if c.family == "narayanan21_tab2" and c.parallel.zero == 3
                else expected.get(c.family, "megatron"))
        assert c.parallel.framework == want, c.id


def test_the_shipped_file_says_where_it_comes_from():
    data = json.loads(cases_module.SHIPPED.read_text())
    assert set(data) == {"about", "cases", "unmodelled"}
    assert "dev.json" in data["about"] and "2205.05198" in data["about"]


def test_runs_without_a_published_layout_are_listed_as_unmodelled_with_the_reason():
    records = cases_module.load_unmodelled()
    assert [r.id for r in records] == ["megatron_core_h100_gpt175B_strong_96gpu",
                                       "megatron_core_h100_gpt175B_strong_4608gpu"]
    assert all("not published" in r.reason and r.source for r in records)


def test_shipped_files_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cases_module.resolve("dev") == cases_module.SHIPPED
    assert len(load_cases("dev")) == 80


def test_the_shipped_file_is_package_data():
    """pyproject's package-data globs for `opgraph` reach data/validation.json, so an install
    carries it (the build itself is checked in test_packaging)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["opgraph"]
    relative = cases_module.SHIPPED.relative_to(ROOT / "opgraph").as_posix()
    assert any(fnmatch.fnmatch(relative, g) for g in globs), globs


def test_a_build_installs_the_shipped_file(tmp_path):
    """setuptools' build of a copy of the sources puts opgraph/data/validation.json in it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "opgraph", "passes", "models"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    lib = tmp_path / "lib"
    done = subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "-q",
                           "build_py", "--build-lib", str(lib)], cwd=src, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(src)})
    if done.returncode:
        pytest.skip(f"setuptools cannot build here: {done.stderr.strip().splitlines()[-1:]}")
    assert (lib / "opgraph" / "data" / "validation.json").is_file()


def test_cases_write_back_to_the_same_cases(shipped, tmp_path):
    path = tmp_path / "again.json"
    path.write_text(json.dumps({"cases": [c.to_json() for c in shipped]}))
    assert load_cases(path) == shipped


# --- the conversions, against the published figures -------------------------------------------
def test_narayanan_1_7b_step_time_from_achieved_tflops(by_id):
    """Table 1's first row: 137 TFLOP/s per GPU on 32 GPUs, batch 512, s 2048, 24 layers,
    h 2304, V 51200; step = F / (TFLOP/s x GPUs)."""
    expected = (96 * 512 * 2048 * 24 * 2304**2
                * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304)) / (137e12 * 32))
    assert by_id["narayanan21_tab1_1.7B"].measured_step_time_s == pytest.approx(expected, rel=1e-4)


def test_torchtitan_step_time_is_the_global_tokens_over_the_jobs_throughput(by_id):
    """5,762 tokens/s per GPU on 8 GPUs, global batch 16 x 8192 tokens: 2.843 s, the step time
    dev.json derives from torchtitan's TPS (tokens per rank per second)."""
    case = by_id["torchtitan_t1_fsdp_8gpu"]
    assert case.measured_tokens_per_s_per_gpu == 5762
    assert case.tokens_per_step == 16 * 8192
    assert case.measured_step_time_s == pytest.approx(16 * 8192 / (5762 * 8))
    assert round(case.measured_step_time_s, 3) == 2.843
    # the same as one rank's tokens over its own throughput: local batch 2 x 8192 / 5762
    assert case.measured_step_time_s == pytest.approx(2 * 8192 / 5762)


# dev.json's recompute text -> the policy (passes/recompute.py POLICIES)
def _recompute(text: str) -> str:
    if text.startswith("full"):
        return "full"
    if text == "selective (attention core only)":
        return "selective"
    if text == "selective":
        return "selective-op"  # torchtitan's selective, option "op" in its config
    assert text.startswith(("none", "not stated")), text  # unstated: the frameworks' default
    return "none"


HARDWARE = {"A100-SXM 80GB": ("a100-sxm-80gb", "dgx-a100"),
            "H100 SXM 96GB HBM2e, 500W power limit (Grand Teton)": ("h100-sxm-96gb", "dgx-h100"),
            "H100 (SXM presumably, peak 989 used)": ("h100-sxm", "dgx-h100"),
            "H100 80GB": ("h100-sxm", "dgx-h100"), "B200": ("b200", "dgx-b200")}


def _hardware(hw: dict) -> tuple[str, str]:
    """The catalog part and cluster a dev record's hardware names: the playbook's runs (AWS
    EFA between nodes) on the cluster whose collective bandwidth it measured."""
    part, cluster = HARDWARE[hw["gpu"]]
    return part, "hf-ultrascale-h100" if "EFA" in (hw.get("inter_node") or "") else cluster


def _dev(shared) -> dict:
    return json.loads((shared / "validation" / "dev.json").read_text())


def _dev_cases(shared) -> list[dict]:
    return _dev(shared)["cases"]


def test_every_dev_case_is_shipped_once(shared, shipped):
    unmodelled = [r.id for r in cases_module.load_unmodelled()]
    assert sorted(c["id"] for c in _dev_cases(shared)) == sorted(
        [c.id for c in shipped] + unmodelled)


def test_every_playbook_sweep_row_is_shipped_once(shared):
    rows = _dev(shared)["playbook_sweep"]
    cases = load_cases("playbook-sweep")
    unmodelled = cases_module.load_unmodelled("playbook-sweep")
    assert sorted(r["id"] for r in rows) == sorted([c.id for c in cases]
                                                   + [u.id for u in unmodelled])
    # the rows left out are those whose layers do not split evenly over the stages
    assert {u.id for u in unmodelled} == {r["id"] for r in rows
                                          if r["model"]["layers"] % r["parallel"]["pp"]}
    by_id = {c.id: c for c in cases}
    for r in rows:
        case = by_id.get(r["id"])
        if case is None:
            continue
        _check_model_dims(case, r["model"])
        assert (case.hardware, case.cluster) == _hardware(r["hardware"])
        _check_layout(case, r)
        _check_measured(case, r)


def _check_model_dims(case: Case, m: dict) -> None:
    if isinstance(case.model, str):  # torchtitan's Llama 3.1 8B as the preset llama3-8b
        dims = case.forward().dims
        assert (dims[D], dims[L], dims[H], dims[H_kv], dims[F], dims[V]) == (
            m["hidden"], m["layers"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"])
        return
    config = case.model
    if config["model_type"] == "llama":
        assert (config["hidden_size"], config["num_hidden_layers"],
                config["num_attention_heads"], config["num_key_value_heads"],
                config["intermediate_size"], config["vocab_size"]) == (
            m["hidden"], m["layers"], m["heads"], m.get("kv_heads") or m["heads"], m["ffn"],
            m["vocab"])
        assert config["tie_word_embeddings"] == bool(m.get("tied"))
        return
    assert config["model_type"] == "gpt2" and m.get("kv_heads", m["heads"]) == m["heads"]
    ffn = m["ffn"] if isinstance(m.get("ffn"), int) else 4 * m["hidden"]  # "4h assumed"
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"],
            config["vocab_size"], config["n_positions"]) == (
        m["hidden"], m["layers"], m["heads"], ffn, m["vocab"], m["seq_len"])
    # Megatron ties them by default; Megatron-Core's table's sizes imply untied ones
    assert config.get("tie_word_embeddings", True) == (case.family != "megatron_core_h100")


def megatron_flops(B, s, l, h, V):
    """Megatron-LM's num_floating_point_operations (@937571cfd4) for multi-head attention and a
    4h MLP, no recomputation, non-causal: 12 B s l h^2 (2 + s/h + 4 + V/(2 l h))."""
    return 12 * B * s * l * h**2 * (2 + s / h + 4 + V / (2 * l * h))


def _check_measured(case: Case, dev: dict) -> None:
    meas, m, p, gpus = dev["measured"], dev["model"], dev["parallel"], dev["hardware"]["num_gpus"]
    if "iteration_time_s" in meas:  # Korthikanti Table 5: the iteration time as published
        assert case.measured_step_time_s == meas["iteration_time_s"]
        assert case.measured_tokens_per_s_per_gpu is None
    elif "iteration_time_ms" in meas:  # SimuMax: milliseconds, and the allocator's peak
        assert case.measured_step_time_s == pytest.approx(meas["iteration_time_ms"] / 1000)
        assert case.measured_peak_memory_gib == meas["peak_alloc_GiB"]
    elif "achieved_tflops_per_gpu" in meas:  # Narayanan Tables 1, 2: F / (TFLOP/s x GPUs)
        flops = narayanan_flops(p["global_batch_seqs"], m["seq_len"], m["layers"], m["hidden"],
                                m["vocab"])
        step = flops / (meas["achieved_tflops_per_gpu"] * 1e12 * gpus)
        assert case.measured_step_time_s == pytest.approx(step, rel=1e-4)
        derived = dev["derived"].get("flops_per_iter_F")
        if derived:
            assert flops == pytest.approx(derived, rel=1e-9)
        else:  # Table 2's derived step, to its printed digits
            assert step == pytest.approx(dev["derived"]["iteration_time_s"], abs=0.01)
        if "aggregate_pflops" in meas:  # the aggregate column gives the same step
            aggregate = flops / (meas["aggregate_pflops"] * 1e15)
            assert case.measured_step_time_s == pytest.approx(aggregate, rel=1e-2)
    elif "tflops_per_gpu" in meas:  # Megatron-Core's table: Megatron's own FLOP count
        flops = megatron_flops(p["global_batch_seqs"], m["seq_len"], m["layers"], m["hidden"],
                               m["vocab"])
        assert flops / (p["global_batch_seqs"] * m["seq_len"]) == pytest.approx(
            dev["derived"]["flops_per_token"], rel=1e-9)
        step = flops / (meas["tflops_per_gpu"] * 1e12 * gpus)
        assert case.measured_step_time_s == pytest.approx(step, rel=1e-9)
        assert step == pytest.approx(dev["derived"]["iteration_time_s"], abs=5e-4)
        # its MFU column is those TFLOP/s over the 989 TFLOP/s peak
        assert meas["tflops_per_gpu"] / 989 == pytest.approx(meas["mfu_pct"] / 100, abs=0.006)
    else:  # tokens/s per GPU kept; step = global tokens / (TPS x GPUs)
        tps = meas["tokens_per_s_per_gpu"]
        assert case.measured_tokens_per_s_per_gpu == tps
        assert case.measured_step_time_s == pytest.approx(
            case.parallel.batch * m["seq_len"] / (tps * gpus))
        if "peak_memory_GiB" in meas:
            assert case.measured_peak_memory_gib == meas["peak_memory_GiB"]
        else:  # the playbook's "41.8 GB": nanotron's benchmark CSV, bytes / 1024**3 (GiB),
            # written on world rank 0 alone (`helpers.py`, `log_throughput`): the first stage's
            assert case.measured_peak_memory_gib == float(meas["gpu_memory_GB"].removesuffix(" GB"))
            assert case.measured_peak_memory_gb is None
            assert case.measured_peak_memory_stage == 0
        if case.parallel.batch == p["global_batch_seqs"]:
            assert case.measured_step_time_s == pytest.approx(dev["derived"]["step_time_s"],
                                                              abs=5e-3)


def _zero(text: str) -> int:
    if text.startswith(("FSDP", "ZeRO-3")):
        return 3
    if text.startswith(("ZeRO-1", "Megatron distributed optimizer", "distributed optimizer")):
        return 1
    return 0


def _unpublished_micro_batch(dev: dict) -> int:
    """The micro-batch a case assumes where its source gives none: one sequence, but for
    Megatron-Core's H100 table without pipeline stages the rank's whole batch in one, as the
    same author's Megatron-LM runs took it where memory allowed (Narayanan et al. 2021 Table 1;
    docs/calibration.md, "What it misses most")."""
    p = dev["parallel"]
    if dev["id"].startswith("megatron_core_h100_") and p["pp"] == 1:
        return p["global_batch_seqs"] // p["dp"]
    return 1


def _check_layout(case: Case, dev: dict) -> None:
    p = dev["parallel"]
    layout = case.parallel
    assert (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp_degree) == (
        p["tp"], p["pp"], p.get("cp") or 1, p.get("ep") or 1, p["dp"])
    assert layout.micro_batch == (p["micro_batch"] or p.get("local_batch_seqs")
                                  or _unpublished_micro_batch(dev))
    if "grad_accum" in p:  # the playbook: the batch the run's own degrees give
        assert layout.batch == p["dp"] * p["micro_batch"] * p["grad_accum"]
    else:
        assert layout.global_batch == p["global_batch_seqs"]
    if "num_microbatches" in p:  # SimuMax's micro-batches per rank
        assert layout.micro_batches == p["num_microbatches"]
    assert layout.virtual_stages == (p.get("virtual_stages") or 1)
    sp = p.get("sequence_parallel", False)
    # a bool where the source says; Megatron's --tp-comm-overlap and nanotron's default imply it
    assert layout.sequence_parallel == (sp if isinstance(sp, bool) else layout.tp > 1)
    assert layout.zero == _zero(p["zero_or_fsdp"])
    assert case.recompute == _recompute(p["recompute"])
    assert case.precision == ("fp8" if "Float8" in p["precision"] else "bf16")
    assert case.fuse == ("elementwise" if "compile" in p.get("techniques", "") else "none")


def test_conversions_follow_dev_json(shared, by_id):
    for dev in _dev_cases(shared):
        case = by_id.get(dev["id"])
        if case is None:  # unmodelled: checked above
            continue
        m, hw = dev["model"], dev["hardware"]
        _check_model_dims(case, m)
        assert case.seq_len == m["seq_len"]
        assert case.gpus == hw["num_gpus"]
        assert (case.hardware, case.cluster) == _hardware(hw)
        _check_layout(case, dev)
        _check_measured(case, dev)


def test_narayanan_interleaving_matches_layers_per_virtual_stage(shared, by_id):
    """run_table_1.sh gives layers per virtual stage; virtual stages = layers / (pp x that)."""
    for dev in _dev_cases(shared):
        per = dev["parallel"].get("layers_per_virtual_stage")
        if per:
            layout = by_id[dev["id"]].parallel
            assert layout.virtual_stages == dev["model"]["layers"] // (layout.pp * per)
            assert layout.micro_batches == dev["parallel"]["num_microbatches_per_replica"]


# --- the models ---------------------------------------------------------------------------------
# The parameter count each model's name gives: the papers' tables and torchtitan's model name.
NAMED_PARAMETERS = {
    "korthikanti22_tab5_22B": 22e9, "korthikanti22_tab5_175B": 175e9,
    "korthikanti22_tab5_530B": 530e9, "korthikanti22_tab5_1T": 1e12,
    "narayanan21_tab1_1.7B": 1.7e9, "narayanan21_tab1_3.6B": 3.6e9,
    "narayanan21_tab1_7.5B": 7.5e9, "narayanan21_tab1_18B": 18.4e9,  # Table 1 prints 18.4
    "narayanan21_tab1_39B": 39.1e9, "narayanan21_tab1_76B": 76.1e9,
    "narayanan21_tab1_145B": 145.6e9, "narayanan21_tab1_310B": 310.1e9,
    "narayanan21_tab1_530B": 529.6e9, "narayanan21_tab1_1T": 1008e9,
    "narayanan21_tab2_zero3_174B": 174.6e9, "narayanan21_tab2_ptd_174B": 174.6e9,  # Table 2
    "narayanan21_tab2_zero3_529B": 529.6e9, "narayanan21_tab2_ptd_529B": 529.6e9,
    "torchtitan_t1": 8e9,  # Llama 3.1 8B
}
# The 1.7B model (h 2304, 24 layers, V 51200, s 2048) has 1.652e9 parameters by the paper's own
# count 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)); its name rounds up by 2.9%. Reported, not bent.
# Where a model's name rounds its size further than 2%: the published name's figure over the
# paper's own parameter formula (12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))), checked as such.
NAME_ABOVE_FORMULA = {"narayanan21_tab1_1.7B": 0.028}  # 1.7e9 named, 1.652e9 by the formula


def _named(case_id: str) -> float | None:
    return next((v for k, v in NAMED_PARAMETERS.items() if case_id.startswith(k + "_")
                 or case_id == k), None)


def llama_parameters(c: dict) -> int:
    """A Llama config's parameters: per layer Q and O (D x D), K and V (D x H_kv d_h each), the
    gated MLP's three D x F matrices and two RMSNorm weights; the embedding, the head unless
    tied, the final norm."""
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
    layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    return c["num_hidden_layers"] * layer + v * d * (1 if c["tie_word_embeddings"] else 2) + d


@pytest.mark.parametrize("case_id", [c.id for c in load_cases()])
def test_every_forward_graph_builds_with_its_published_size(case_id, by_id):
    case = by_id[case_id]
    graph = case.forward()
    verify(graph)
    assert graph.seq_len == case.seq_len and graph.dims[S] == case.seq_len
    params = float(graph.parameters().subs(graph.dims))
    named = _named(case_id)
    if named is not None:
        above = NAME_ABOVE_FORMULA.get(case_id, 0.0)
        assert params == pytest.approx(named * (1 - above), rel=0.02 if not above else 0.002)
    elif case.family == "megatron_core_h100":
        # the table's sizes are 12 l h^2 + 2 V h (untied), its dev.json record says; the GPT
        # graph adds biases, norms and the position table, under 3% here
        c = case.model
        h, l, v = c["n_embd"], c["n_layer"], c["vocab_size"]
        assert params == pytest.approx(12 * l * h**2 + 2 * v * h, rel=0.03)
        assert params == pytest.approx(float(case_id.split("_")[-1].rstrip("B")) * 1e9,
                                       rel=0.035)
    else:  # Llama-style configs: SimuMax's truncated models, the playbook's
        assert params == llama_parameters(case.model)


def test_gpt_parameters_are_narayanans_formula_plus_the_final_norm(by_id):
    """Megatron GPT: per layer 12h^2 + 13h (QKV, output, 4h MLP with biases, two LayerNorms),
    tied embedding V h, learned positions s h; the paper's formula leaves out the final
    LayerNorm's 2h."""
    for case in by_id.values():
        if isinstance(case.model, str) or case.model["model_type"] != "gpt2":
            continue
        c = case.model
        h, l, v, s = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_positions"]
        graph = case.forward()
        tied = c.get("tie_word_embeddings", True)
        assert graph.parameters().subs(graph.dims) == (
            12 * l * h**2 + 13 * l * h + (v * (1 if tied else 2) + s) * h + 2 * h)


def test_narayanan_1_7b_is_1_65_billion_parameters(by_id):
    """The disagreement reported above, as the formula gives it."""
    h, l, v, s = 2304, 24, 51200, 2048
    paper = 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    graph = by_id["narayanan21_tab1_1.7B"].forward()
    assert float(graph.parameters().subs(graph.dims)) == pytest.approx(paper + 2 * h)
    assert paper / 1.7e9 == pytest.approx(0.972, abs=1e-3)


def test_a_preset_keeps_its_name_and_a_config_takes_the_case_id(by_id):
    assert by_id["torchtitan_t1_fsdp_8gpu"].forward().name == "llama3-8b"
    assert by_id["narayanan21_tab1_18B"].forward().name == "narayanan21_tab1_18B"


def test_the_model_is_read_only(by_id):
    with pytest.raises(TypeError):
        by_id["narayanan21_tab1_18B"].model["n_layer"] = 1


# --- bad input ----------------------------------------------------------------------------------
GOOD = {
    "id": "mine",
    "source": "a test",
    "model": {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4,
              "vocab_size": 100, "n_positions": 128},
    "gpus": 8,
    "parallel": {"tp": 2, "pp": 2, "micro_batch": 1, "global_batch": 8},
    "seq_len": 128,
    "measured": {"step_time_s": 1.5},
}


def _write(tmp_path, data) -> Path:
    path = tmp_path / "cases.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _with(change) -> dict:
    case = copy.deepcopy(GOOD)
    change(case)
    return {"cases": [case]}


def test_a_small_good_case_takes_the_clis_defaults(tmp_path):
    (case,) = load_cases(_write(tmp_path, {"cases": [GOOD]}))
    assert (case.hardware, case.cluster, case.recompute, case.precision, case.fuse) == (
        "h100-sxm", None, "none", "bf16", "none")
    layout = case.parallel
    assert (layout.cp, layout.ep, layout.dp_degree, layout.zero, layout.virtual_stages) == (
        1, 1, 2, 0, 1)
    assert not layout.sequence_parallel and not layout.async_tp
    assert case.measured_peak_memory_gib is None and case.notes == ""
    again = _write(tmp_path, {"cases": [case.to_json()]})
    assert "cluster" not in case.to_json() and load_cases(again) == [case]


def test_a_case_runs_hsdp_replicas(tmp_path):
    """`replicate` in a case's parallel block: written back only where there are replicas, and
    checked as a layout checks it."""
    (case,) = load_cases(_write(tmp_path, _with(
        lambda c: c["parallel"].update(tp=1, zero=3, replicate=2))))
    assert (case.parallel.dp_degree, case.parallel.replicate, case.parallel.size("dp")) == (4, 2, 2)
    assert case.to_json()["parallel"]["replicate"] == 2
    assert load_cases(_write(tmp_path, {"cases": [case.to_json()]})) == [case]
    assert "replicate" not in load_cases(_write(tmp_path, {"cases": [GOOD]}))[0].to_json()[
        "parallel"]
    with pytest.raises(OpgraphError, match="--zero 1, 2 or 3"):
        load_cases(_write(tmp_path, _with(lambda c: c["parallel"].update(tp=1, replicate=2))))


def test_a_case_runs_context_parallelism_by_all_to_all(tmp_path):
    """`cp_comm` in a case's parallel block: written back only where it is the all-to-all, and
    read as a choice of `CP_COMMS`."""
    (case,) = load_cases(_write(tmp_path, _with(
        lambda c: c["parallel"].update(cp=2, cp_comm="a2a"))))
    assert (case.parallel.cp, case.parallel.cp_comm) == (2, "a2a")
    assert case.to_json()["parallel"]["cp_comm"] == "a2a"
    assert load_cases(_write(tmp_path, {"cases": [case.to_json()]})) == [case]
    assert "cp_comm" not in load_cases(_write(tmp_path, {"cases": [GOOD]}))[0].to_json()[
        "parallel"]
    with pytest.raises(OpgraphError, match="a context-parallel communication"):
        load_cases(_write(tmp_path, _with(lambda c: c["parallel"].update(cp_comm="ulysses"))))


def test_a_case_says_every_stages_layers(tmp_path):
    (case,) = load_cases(_write(tmp_path, _with(
        lambda c: c["parallel"].update(stage_layers=[3, 1]))))
    assert case.parallel.stage_layers == (3, 1)
    assert load_cases(_write(tmp_path, {"cases": [case.to_json()]})) == [case]
    for bad in ([3, 2], [3], "3/1", [3, -1]):
        with pytest.raises(OpgraphError, match="stage"):
            (case,) = load_cases(_write(tmp_path, _with(
                lambda c, bad=bad: c["parallel"].update(stage_layers=bad))))
            stage_layers(4, case.parallel)


def test_a_cases_stage_layers_count_the_stack_the_pipeline_splits(tmp_path):
    """A small DeepSeek-V2 config of 1 dense layer and 4 of experts: the pipeline splits the 4
    (the dense one runs on the first stage), as `profile --stage-layers` counts them, so a
    case file reads [3, 1] and refuses [4, 1], saying which layers it counts."""
    model = {"model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 128,
             "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
             "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
             "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
             "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
             "qk_nope_head_dim": 8, "v_head_dim": 16, "vocab_size": 100,
             "max_position_embeddings": 128}

    def deepseek(layers):
        return _with(lambda c: (c.update(model=model),
                                c["parallel"].update(tp=1, stage_layers=layers)))

    (case,) = load_cases(_write(tmp_path, deepseek([3, 1])))
    assert case.parallel.stage_layers == (3, 1)
    with pytest.raises(OpgraphError) as err:
        load_cases(_write(tmp_path, deepseek([4, 1])))
    message = str(err.value)
    assert "add up to 5; the layer stack has 4" in message and "dense_layers" in message
    assert "\n" not in message


BAD = [  # (what, the file's data, words the message must hold)
    ("unknown case key", _with(lambda c: c.update(gpu=8)), ["'gpu'", "mine"]),
    ("unknown parallel key", _with(lambda c: c["parallel"].update(tensor_parallel=2)),
     ["'tensor_parallel'", "parallel", "mine"]),
    ("unknown measured key", _with(lambda c: c["measured"].update(mfu=0.5)), ["'mfu'", "mine"]),
    ("unknown top key", {"cases": [GOOD], "version": 1}, ["'version'"]),
    ("duplicate id", {"cases": [GOOD, GOOD]}, ["mine", "twice"]),
    ("missing key", _with(lambda c: c.pop("seq_len")), ["'seq_len'", "mine"]),
    ("id with a space", _with(lambda c: c.update(id="my case")), ["id", "letters"]),
    ("gpus as text", _with(lambda c: c.update(gpus="8")), ["gpus", "whole number"]),
    ("gpus as true", _with(lambda c: c.update(gpus=True)), ["gpus", "whole number"]),
    ("seq_len zero", _with(lambda c: c.update(seq_len=0)), ["seq_len", "not positive"]),
    ("fractional degree", _with(lambda c: c["parallel"].update(tp=1.5)), ["parallel.tp"]),
    ("flag as text", _with(lambda c: c["parallel"].update(sequence_parallel="yes")),
     ["parallel.sequence_parallel", "true or false"]),
    ("zero stage 4", _with(lambda c: c["parallel"].update(zero=4)), ["parallel.zero", "0, 1"]),
    ("zero stage 1.0", _with(lambda c: c["parallel"].update(zero=1.0)), ["parallel.zero"]),
    ("a time too large for a float", _with(lambda c: c["measured"].update(step_time_s=10**400)),
     ["measured.step_time_s", "positive"]),
    ("negative time", _with(lambda c: c["measured"].update(step_time_s=-1)),
     ["measured.step_time_s", "positive"]),
    ("NaN time", '{"cases": [' + json.dumps(GOOD).replace("1.5", "NaN") + "]}",
     ["measured.step_time_s", "positive"]),
    ("both timings", _with(lambda c: c["measured"].update(tokens_per_s_per_gpu=100)),
     ["not both"]),
    ("no timing", _with(lambda c: c.update(measured={"peak_memory_gib": 70})),
     ["step_time_s", "tokens_per_s_per_gpu"]),
    ("measured not an object", _with(lambda c: c.update(measured=1.5)), ["measured"]),
    ("memory stage past the pipeline", _with(lambda c: c["measured"].update(
        peak_memory_stage=2)), ["measured.peak_memory_stage", "2 pipeline stages", "0 to 1"]),
    ("memory stage negative", _with(lambda c: c["measured"].update(peak_memory_stage=-1)),
     ["measured.peak_memory_stage", "from 0"]),
    ("unknown preset", _with(lambda c: c.update(model="gpt5")), ["gpt5", "llama3-8b"]),
    ("model a number", _with(lambda c: c.update(model=7)), ["model", "preset"]),
    ("config without model_type", _with(lambda c: c["model"].pop("model_type")),
     ["model_type", "mine"]),
    ("config of an unread type", _with(lambda c: c["model"].update(model_type="t5")),
     ["t5", "gpt2"]),
    ("config missing a field", _with(lambda c: c["model"].pop("n_head")),
     ["'n_head'", "mine", "cases.json"]),
    ("seq_len past the positions", _with(lambda c: c.update(seq_len=256)),
     ["256", "128 positions"]),
    ("unknown hardware", _with(lambda c: c.update(hardware="h300")), ["h300", "h100-sxm"]),
    ("unknown cluster", _with(lambda c: c.update(cluster="dgx-z")), ["dgx-z", "dgx-h100"]),
    ("unknown recompute", _with(lambda c: c.update(recompute="some")), ["some", "selective-op"]),
    ("unknown precision", _with(lambda c: c.update(precision="fp16")), ["fp16", "bf16"]),
    ("unknown fusion", _with(lambda c: c.update(fuse="all")), ["all", "elementwise"]),
    ("fp8 on a part without it", _with(lambda c: c.update(hardware="a100-sxm-80gb",
                                                          precision="fp8")), ["fp8", "a100"]),
    ("gpus not tp x cp x pp x dp", _with(lambda c: c["parallel"].update(dp=3)),
     ["mine", "--gpus 8"]),
    ("layers over the stages", _with(lambda c: c["parallel"].update(virtual_stages=3)),
     ["4 layers", "mine"]),
    ("not JSON", "{cases: []}", ["not valid JSON"]),
    ("a list", "[]", ['"cases"']),
    ("no cases", {"cases": []}, ["no cases"]),
    ("a key twice in an object", '{"cases": [], "cases": []}', ["'cases'", "twice"]),
    ("a case not an object", {"cases": [3]}, ["cases[0]"]),
]


@pytest.mark.parametrize("what, data, needles", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line(tmp_path, what, data, needles):
    with pytest.raises(OpgraphError) as caught:
        load_cases(_write(tmp_path, data))
    message = str(caught.value)
    assert "\n" not in message and message
    for needle in needles:
        assert needle in message, (what, message)


def test_a_missing_or_empty_path_is_one_line(tmp_path):
    for path in (tmp_path / "nothing.json", ""):
        with pytest.raises(OpgraphError) as caught:
            load_cases(path)
        assert "\n" not in str(caught.value)


def test_every_layout_field_has_a_case_reader():
    """A case's `parallel` block takes each field of a layout (`Parallel`) but `gpus`, which
    the case gives beside it; a field added to the layout needs a reader of its values."""
    from opgraph.io.cases import PARALLEL_KEYS, READERS

    missing = [key for key in PARALLEL_KEYS if key not in READERS]
    assert not missing


# --- a part or a cluster the catalog lacks, given inline ------------------------------------------

def _catalog_table(file: str, key: str) -> dict:
    return tomllib.loads((ROOT / "opgraph" / file).read_text())[key]


def _inline(case: Case, **changes) -> dict:
    table = case.to_json()
    table.update(changes)
    return table


def test_a_part_and_a_cluster_given_inline_predict_as_their_catalog_ids(shipped):
    """A case may give its part and its cluster as objects with a hardware or cluster file's
    fields and an id: with the catalog's own tables the prediction is the catalog ids' to the
    last digit, and the case writes them back as given."""
    from opgraph.analysis.validate import predict

    (case,) = [c for c in shipped if c.id == "korthikanti22_tab5_22B_seqsel"]
    assert (case.hardware, case.cluster) == ("a100-sxm-80gb", "dgx-a100")
    part = {"id": "my-a100", **_catalog_table("hardware.toml", "a100-sxm-80gb")}
    cluster = {"id": "my-dgx", **_catalog_table("cluster.toml", "dgx-a100")}
    inline = cases_module.read_case(_inline(case, hardware=part, cluster=cluster))
    assert inline.part_id == "my-a100" and inline.resolved_cluster().id == "my-dgx"
    assert predict(inline).predicted_step_time_s == predict(case).predicted_step_time_s
    again = cases_module.read_case(json.loads(json.dumps(inline.to_json())))
    assert again == inline and again.to_json()["hardware"] == part


def test_an_inline_cluster_is_the_network_the_run_gets(shipped):
    """Half the catalog cluster's network bandwidth (a site with one 100 Gb/s NIC per GPU
    where the DGX has 200): a run whose data-parallel reduction crosses nodes gets slower,
    by no more than its cross-node communication takes twice."""
    from opgraph.analysis.validate import predict

    (case,) = [c for c in shipped if c.id == "narayanan21_tab2_zero3_174B_768gpu"]
    base = case.resolved_cluster()
    table = _catalog_table("cluster.toml", base.id)
    slow = {"id": "half", **table, "network": {**table["network"],
                                               "gbits_per_s": table["network"]["gbits_per_s"] / 2}}
    slower = cases_module.read_case(_inline(case, cluster=slow))
    assert slower.resolved_cluster().tiers[1].bandwidth == pytest.approx(
        base.tiers[1].bandwidth / 2, rel=1e-12)
    assert predict(slower).predicted_step_time_s > predict(case).predicted_step_time_s


@pytest.mark.parametrize("key, value, says", [
    ("hardware", {"id": "x", "bf16_tflops": 100}, "missing bandwidth_tbs"),
    ("hardware", {"id": "x", "bf16_tflops": 100, "bandwidth_tbs": 1, "speed": 3},
     "unknown key"),
    ("hardware", {"id": "", "bf16_tflops": 100, "bandwidth_tbs": 1}, "must name the part"),
    ("hardware", "h900", "or give an object"),
    ("cluster", {"id": "c", "gpus_per_node": 8}, "missing node"),
    ("cluster", [8, 400], "choose a catalog cluster"),
])
def test_a_bad_inline_part_or_cluster_is_one_line_naming_the_case(shipped, key, value, says):
    case = shipped[0]
    with pytest.raises(OpgraphError) as e:
        cases_module.read_case(_inline(case, **{key: value}))
    message = str(e.value)
    assert says in message and case.id in message and "\n" not in message


def test_the_docs_example_case_file_is_read_and_predicted(tmp_path):
    """docs/calibration.md's example of a case file of one's own (a part and a cluster the
    catalog lacks, given inline) reads, and `validate` predicts it."""
    text = (ROOT / "docs" / "calibration.md").read_text()
    start = text.index("```json\n", text.index("**Your own runs.**")) + len("```json\n")
    path = tmp_path / "mine.json"
    path.write_text(text[start:text.index("```", start)])
    (case,) = load_cases(path)
    assert (case.part_id, case.resolved_cluster().id) == ("my-gpu", "our-ib")
    from opgraph.analysis.validate import predict

    assert predict(case).predicted_step_time_s > 0


def test_a_power_limit_on_an_inline_part_without_its_power_is_refused_when_read(shipped):
    """A power cap scales the clock by the part's board power: an inline part that gives none
    under a case's `power_limit_w` is one line when the file is read, naming the case."""
    table = shipped[0].to_json()
    table["hardware"] = {"id": "x", "bf16_tflops": 100, "bandwidth_tbs": 1,
                         "cluster": "dgx-h100"}
    table["power_limit_w"] = 500
    with pytest.raises(OpgraphError, match=f"case {shipped[0].id}: hardware x has no tdp_w"):
        cases_module.read_case(table)


def test_an_inline_part_needs_a_cluster(shipped):
    """A part given inline that names no default cluster, in a case that gives none: one line
    when the file is read, not a run skipped later."""
    table = shipped[0].to_json()
    table.pop("cluster", None)
    table["hardware"] = {"id": "x", "bf16_tflops": 100, "bandwidth_tbs": 1}
    with pytest.raises(OpgraphError, match="names no cluster"):
        cases_module.read_case(table)
