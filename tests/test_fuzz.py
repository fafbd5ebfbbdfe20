"""Issue 8's fuzzing cases for the command line (1-4, 5's config part, 6, 7, 9's config and
hardware part, 11, 12, 13): each is exit status 2, one line on stderr, no traceback, and every
file in the folder exactly as it was (no file written, replaced or removed)."""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opgraph.core.errors import OpgraphError
from opgraph.io.outputs.atomic import check_output, check_outputs, outputs, write_atomic

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8,
         "num_hidden_layers": 2, "intermediate_size": 1024, "vocab_size": 1000,
         "max_position_embeddings": 2048}
BIG = "1" + "0" * 400  # 10**400, beyond a float
HUGE = "9" * 5000  # more digits than int() converts


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An empty folder as the issue ran them in, with the inputs the cases name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "c.json").write_text(json.dumps(LLAMA))
    (tmp_path / "hw.toml").write_text("[gpu]\nbf16_tflops = 100\nbandwidth_tbs = 2\n")
    (tmp_path / "x.png").write_bytes(b"\x89PNG an old figure")
    (tmp_path / "p.png").write_bytes(b"\x89PNG an old figure")
    (tmp_path / "d.csv").mkdir()
    (tmp_path / "to-config.json").symlink_to("config.json")
    os.link(tmp_path / "c.json", tmp_path / "hard.json")
    os.mkfifo(tmp_path / "fifo.json")
    return tmp_path


def snapshot(root: Path) -> dict:
    """Every entry under `root`: a file's hash, a link's target, a folder, a FIFO."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = ("link", os.readlink(path))
        elif path.is_fifo():
            out[key] = ("fifo",)
        elif path.is_dir():
            out[key] = ("dir",)
        else:
            out[key] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def refused(cli, root: Path, *argv: str) -> str:
    before = snapshot(root)
    code, out, err = cli(*argv)
    assert code == 2, (argv, out, err)
    assert out == ""
    assert err.startswith("opgraph: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert snapshot(root) == before
    return err


def write_config(root: Path, name: str, text: str) -> str:
    (root / name).write_text(text)
    return name


CASES = {
    # 1. write errors
    "out is a directory": (["sweep", "--out", "d.csv"], "is a directory"),
    # 2. a failed run leaves nothing behind
    "plot then a bad trace": (["profile", "--plot", "p.png", "--trace", "no/such/t.json"],
                              "does not exist"),
    "new plot then a bad trace": (["profile", "--plot", "new.png", "--trace", "no/t.json"],
                                  "does not exist"),
    "sweep plot then a bad out": (["sweep", "--tokens", "8192,16384", "--plot", "p.png", "--out",
                                   "no/s.csv"], "does not exist"),
    # 3. outputs never replace inputs, devices, each other
    "trace over its config": (["profile", "--config", "config.json", "--trace", "config.json"],
                              "is an input"),
    "out over its config": (["sweep", "--config", "c.json", "--out", "c.json"], "is an input"),
    "trace over its hardware": (["profile", "--hardware", "hw.toml", "--trace", "hw.toml"],
                                "is an input"),
    "trace onto the plot": (["profile", "--plot", "x.png", "--trace", "x.png"], "same file"),
    "trace through a link to the config": (["profile", "--config", "config.json", "--trace",
                                            "to-config.json"], "is an input"),
    "out over a hard link of the config": (["sweep", "--config", "c.json", "--out", "hard.json"],
                                           "is an input"),
    "config folder's config.json": (["profile", "--config", ".", "--trace", "config.json"],
                                    "is an input"),
    "trace onto a FIFO": (["profile", "--trace", "fifo.json"], "not a regular file"),
    # 4. hardware figures that overflow after scaling
    "peak 1e300": (["profile", "--peak-tflops", "1e300"], "out of range"),
    "peak 1e300 json": (["profile", "--json", "--peak-tflops", "1e300"], "out of range"),
    "bandwidth 1e300 sweep": (["sweep", "--bandwidth-tbs", "1e300"], "out of range"),
    "peak denormal": (["profile", "--peak-tflops", "1e-320"], "out of range"),
    "peak denormal solve": (["solve", "--category", "optimizer", "--max-share", "0.02",
                             "--peak-tflops", "1e-320"], "out of range"),
    "bandwidth 1e300 formula": (["formula", "--quantity", "time", "--numeric-hardware",
                                 "--bandwidth-tbs", "1e300"], "out of range"),
    "peak 1e7 (inside floats, outside the part range)": (["profile", "--peak-tflops", "1e7"],
                                                         "out of range"),
    # 6. sweep values beyond 64-bit integers, products that wrap
    "sweep tokens 2**63": (["sweep", "--tokens", "9223372036854775808"], "bound"),
    "sweep seq_len x batch wraps": (["sweep", "--seq-len", "4294967296", "--batch",
                                     "4294967296"], "bound"),
    "sweep product over the bound": (["sweep", "--seq-len", "1048576", "--batch", "2097152"],
                                     "tokens per step"),
    "sweep dim beyond int()": (["sweep", "--dim", f"L={HUGE}"], "bound"),
    # 7. integers too large for a float
    "tokens 10**400": (["profile", "--tokens", BIG], "bound"),
    "seq_len 10**400": (["profile", "--seq-len", BIG], "bound"),
    "seq_len 10**200": (["profile", "--seq-len", "1" + "0" * 200], "bound"),
    "sweep tokens 10**400": (["sweep", "--tokens", BIG], "bound"),
    "steps 10**400": (["compare", "t.json", "--steps", BIG], "bound"),
    "max-share 1e-300": (["solve", "--category", "optimizer", "--max-share", "1e-300"],
                         "out of range"),
    "rows beyond int()": (["sweep", "--rows", HUGE], "bound"),
    # 9. endless inputs
    "config /dev/zero": (["profile", "--config", "/dev/zero"], "larger than"),
    "hardware /dev/zero": (["profile", "--hardware", "/dev/zero"], "larger than"),
    "config a FIFO": (["profile", "--config", "fifo.json"], "is a FIFO"),
    # 11. sweep refuses what profile refuses
    "gpt2 beyond its positions": (["sweep", "--model", "gpt2", "--seq-len", "2048"],
                                  "1,024 positions"),
    "gpt2 beyond its positions, tokens/batch": (["sweep", "--model", "gpt2", "--tokens", "4096",
                                                 "--batch", "1"], "1,024 positions"),
    # 12. a newline in an output path
    "newline in trace": (["profile", "--trace", "a\nb.json"], "control character"),
    "newline in out": (["sweep", "--out", "a\nb.csv"], "control character"),
    "newline in plot": (["profile", "--plot", "a\nb.png"], "control character"),
    "newline in config": (["profile", "--config", "a\nb.json"], "does not exist"),
    # 13. empty strings
    "empty model": (["profile", "--model", ""], "empty"),
    "empty trace": (["profile", "--trace", ""], "empty"),
    "empty plot": (["profile", "--plot", ""], "empty"),
    "empty out": (["sweep", "--out", ""], "empty"),
    "empty config": (["profile", "--config", ""], "empty"),
    "blank hardware": (["profile", "--hardware", " "], "empty"),
}


@pytest.mark.parametrize("argv, says", CASES.values(), ids=CASES.keys())
def test_fuzz_case(cli, folder, argv, says):
    assert says in refused(cli, folder, *argv)


CONFIGS = {  # 5. config.json shapes that escape the reader; 7. a layer count beyond floats
    "unhashable model_type": (json.dumps({"model_type": ["llama"]}), "not supported"),
    "nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
    "an integer of 5,000 digits": ('{"model_type": "llama", "hidden_size": ' + HUGE + "}",
                                   "4300 digits"),
    "num_hidden_layers 10**300": (json.dumps({**LLAMA, "num_hidden_layers": 10**300}),
                                  "bound"),
    "vocab 2**31": (json.dumps({**LLAMA, "vocab_size": 2**31}), "bound"),
}


@pytest.mark.parametrize("text, says", CONFIGS.values(), ids=CONFIGS.keys())
def test_fuzz_config(cli, folder, text, says):
    name = write_config(folder, "bad.json", text)
    assert says in refused(cli, folder, "profile", "--config", name)


TOMLS = {  # 4. a memory that overflows; 5/9 for the hardware reader
    "memory_gb 1e300": ("[g]\nbf16_tflops = 100\nbandwidth_tbs = 2\nmemory_gb = 1e300\n",
                        "memory_gb = 1e+300 is out of range"),
    "bf16_tflops 1e-320": ("[g]\nbf16_tflops = 1e-320\nbandwidth_tbs = 2\n", "out of range"),
    "an integer of 5,000 digits": ("[g]\nbf16_tflops = " + HUGE + "\nbandwidth_tbs = 2\n",
                                   "4300 digits"),
    "nested 100,000 deep": ("a = " + "[" * 100_000 + "]" * 100_000 + "\n", "nests too deeply"),
}


@pytest.mark.parametrize("text, says", TOMLS.values(), ids=TOMLS.keys())
def test_fuzz_hardware_file(cli, folder, text, says):
    name = write_config(folder, "bad.toml", text)
    for argv in (["profile", "--hardware", name], ["profile", "--json", "--hardware", name],
                 ["hardware", name, "--json"], ["sweep", "--hardware", f"h100-sxm,{name}"]):
        assert says in refused(cli, folder, *argv)


def test_a_read_only_folder(cli, folder):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    (folder / "ro").mkdir()
    (folder / "ro").chmod(0o555)
    try:
        assert "cannot write" in refused(cli, folder, "sweep", "--out", "ro/s.csv")
    finally:
        (folder / "ro").chmod(0o755)


def test_a_read_only_file_system(cli, folder, monkeypatch):
    """What root cannot be shown with chmod: the OS refusing the temp file is one line."""
    from opgraph.io.outputs import atomic

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    err = refused(cli, folder, "sweep", "--tokens", "8192,16384", "--out", "s.csv")
    assert err == "opgraph: error: cannot write s.csv: Read-only file system\n"


def test_a_folder_name_is_not_a_file_name(cli, folder):
    assert "names a folder" in refused(cli, folder, "profile", "--trace", "new/")


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_a_full_disk(tmp_path):
    """A file size limit of 64 KiB: the sweep's 10,000 rows do not fit."""
    (tmp_path / "s.csv").write_text("an old sweep\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["prlimit", "--fsize=65536", "--", sys.executable, "-m", "opgraph",
                           "sweep", "--tokens", "8192:81920000:+8192", "--out", "s.csv"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
                          check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "opgraph: error: cannot write s.csv: File too large\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv"]  # no temp file left
    assert (tmp_path / "s.csv").read_text() == "an old sweep\n"


def test_a_symlink_is_written_through(cli, folder):
    (folder / "out").mkdir()
    (folder / "out" / "real.json").write_text("old")
    (folder / "link.json").symlink_to("out/real.json")
    code, _, _ = cli("profile", "--model", "gpt2", "--trace", "link.json")
    assert code == 0
    assert os.readlink(folder / "link.json") == "out/real.json"  # the link kept
    trace = json.loads((folder / "out" / "real.json").read_text())  # its target replaced
    assert trace["otherData"]["model"] == "gpt2"


def test_json_is_never_infinite(cli, folder):
    """The largest figures the bounds allow still print as finite JSON numbers."""
    code, out, _ = cli("profile", "--json", "--peak-tflops", "1e-6", "--bandwidth-tbs", "1e-6",
                       "--seq-len", str(2**30), "--config", "config.json")
    assert code == 0
    j = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert 0 < j["step_time_s"] < 1e60


def test_check_outputs_refuses_devices_and_accepts_new_files(tmp_path):
    with pytest.raises(OpgraphError, match="not a regular file"):
        check_output("/dev/null", "--trace")  # checked only: nothing is written
    assert check_outputs({"--out": tmp_path / "new.csv", "--plot": None}) == {
        "--out": tmp_path / "new.csv"}


def test_outputs_are_all_or_nothing(tmp_path):
    """Inside `outputs()`, a failure after one file is written replaces none."""
    (tmp_path / "a.txt").write_text("old a")
    with pytest.raises(RuntimeError), outputs():
        write_atomic(tmp_path / "a.txt", lambda f: f.write("new a"))
        write_atomic(tmp_path / "b.txt", lambda f: (_ for _ in ()).throw(RuntimeError("x")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    assert (tmp_path / "a.txt").read_text() == "old a"
    with outputs():
        write_atomic(tmp_path / "a.txt", lambda f: f.write("new a"))
        assert (tmp_path / "a.txt").read_text() == "old a"  # not before the block ends
    assert (tmp_path / "a.txt").read_text() == "new a"


def test_version(cli):
    from opgraph import __version__

    code, out, err = cli("--version")
    assert (code, out, err) == (0, f"opgraph {__version__}\n", "")


# --- random layouts ----------------------------------------------------------------------------

def _random_profile_argv(rng) -> list[str]:
    """One `profile` command line drawn from the layout, framework, precision and optimizer
    flags (degrees, ZeRO stages, schedules, dtypes, kernels); many draws ask for what no
    framework runs or the model does not divide, which must be refused as such."""
    model = rng.choice(["llama3.2-1b", "gpt2", "gemma2-2b", "qwen2-7b", "mixtral-8x7b",
                        "deepseek-v2-lite", "bert-base"])
    tp, pp, cp, dp = (rng.choice(c) for c in ([1, 1, 2, 4, 8], [1, 1, 2, 4], [1, 1, 2],
                                              [1, 2, 4, 8]))
    argv = ["profile", "--model", model, "--hardware",
            rng.choice(["h100-sxm", "a100-sxm-40gb", "b200", "gb200", "mi300x", "l40s"]),
            "--cost", rng.choice(["roofline", "calibrated"]), "--gpus", str(tp * pp * cp * dp),
            "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--dp", str(dp),
            "--micro-batch", str(rng.choice([1, 2]))]
    if model in ("mixtral-8x7b", "deepseek-v2-lite"):
        argv += ["--ep", str(rng.choice([1, 2, 4, 8]))]
    options = [
        ("--framework", ["megatron", "deepspeed", "torchtitan", "nanotron", "composer",
                         "deepspeed-bf16"]),
        ("--zero", ["0", "1", "2", "3"]), ("--replicate", ["1", "2"]),
        ("--recompute", ["none", "selective", "selective-op", "full"]),
        ("--precision", ["bf16", "fp8"]),
        ("--adamw", ["mixed", "bf16-moments", "no-master", "bf16", "8bit"]),
        ("--virtual-stages", ["2", "4"]), ("--cp-comm", ["ring", "a2a"]),
        ("--grad-reduce-dtype", ["fp32", "bf16"]),
        ("--attention-library", ["flash", "cudnn", "triton"]),
        ("--first-stage-layers", ["1", "3"]), ("--seq-len", ["512", "2048"]),
        ("--fuse", ["elementwise"])]
    for flag, values in options:
        if rng.random() < 0.3:
            argv += [flag, rng.choice(values)]
    for flag in ("--sequence-parallel", "--async-tp", "--overlap-param-gather",
                 "--no-overlap-grad-reduce", "--json"):
        if rng.random() < 0.15:
            argv.append(flag)
    return argv


def test_random_layouts_profile_or_are_refused(cli):
    """Seeded draws of profile's flags: each profiles (status 0) or is refused in one line
    (status 2), never a traceback. A draw that once raised: ZeRO with AdamW's no-master or
    bf16 options (the update writes the weights themselves), with and without pipelines and
    --overlap-param-gather."""
    import random

    rng = random.Random(20261206)
    seen = {0: 0, 2: 0}
    for _ in range(150):
        argv = _random_profile_argv(rng)
        code, _, err = cli(*argv)
        assert code in (0, 2), argv
        assert "Traceback" not in err, argv
        if code == 2:
            assert err.startswith("opgraph: error:") and err.count("\n") == 1, (argv, err)
        seen[code] += 1
    assert min(seen.values()) > 30  # both kinds of outcome are exercised
    for zero in ("1", "2", "3"):  # the draws that raised, each ZeRO stage: all run
        for adamw in ("no-master", "bf16"):
            overlap = ["--overlap-param-gather"] if zero != "3" else []
            code, _, err = cli("profile", "--model", "bert-base", "--gpus", "8", "--pp", "2",
                               "--dp", "4", "--zero", zero, "--adamw", adamw, *overlap)
            assert code == 0, err
