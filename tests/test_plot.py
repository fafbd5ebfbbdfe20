"""The plate's figure (`opgraph profile --plot`) and the sweep's: real PNGs of a sensible size,
written atomically; matplotlib stays out of everything else."""

import struct
import subprocess
import sys
import zlib

import pytest
from opgraph.models import preset

from opgraph import compile_step, evaluate, hardware
from opgraph.cli import main
from opgraph.core.errors import OpgraphError
from opgraph.io.outputs.plot import plot_profile, plot_sweep, profile_title

pytest.importorskip("matplotlib")

H100 = hardware.get("h100-sxm")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, checking the signature and the chunk's CRC."""
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:16 + length]
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert crc == zlib.crc32(kind + body)
    width, height = struct.unpack(">II", body[:8])
    assert data.endswith(b"IEND\xaeB`\x82")  # the closing chunk: the file is whole
    return width, height


@pytest.fixture(scope="module")
def step():
    return compile_step(preset("llama3-8b"))


@pytest.fixture(scope="module")
def profile(step):
    return evaluate(step, H100)


@pytest.fixture(scope="module")
def sweep_rows(step):
    """A tokens sweep from several `evaluate` calls, as the columns `opgraph sweep` makes."""
    rows = {"tokens": [], "batch": [], "seq_len": [], "step_time_s": [], "mfu_ceiling": []}
    for batch in (1, 2, 4, 8, 16, 32):
        p = evaluate(step, H100, {"B": batch})
        rows["tokens"].append(p.tokens)
        rows["batch"].append(batch)
        rows["seq_len"].append(p.seq_len)
        rows["step_time_s"].append(p.step_time_s)
        rows["mfu_ceiling"].append(p.mfu_ceiling)
        for c in p.categories:
            rows.setdefault(f"{c.name}_time_share", []).append(c.time_share)
    return rows


def test_figure_is_a_png(profile, tmp_path):
    out = tmp_path / "plate.png"
    plot_profile(profile, out)
    data = out.read_bytes()
    width, height = png_size(data)
    assert 400 <= width <= 3000 and 300 <= height <= 3000
    assert 10_000 < len(data) < 200_000
    assert [p.name for p in tmp_path.iterdir()] == ["plate.png"]  # no temp file left


def test_figure_as_svg(profile, tmp_path):
    out = tmp_path / "plate.svg"
    plot_profile(profile, out)
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "MFU ceiling" in text  # the title is drawn as text


def test_title_names_the_setup(profile):
    title = profile_title(profile)
    for part in ("llama3-8b", H100.name, "8,192 tokens per step", "(1 x 8,192)",
                 "fused attention", f"{profile.step_time_s * 1e3:.1f} ms",
                 f"MFU ceiling {profile.mfu_ceiling * 100:.1f}%"):
        assert part in title


def test_sweep_plot_is_a_png(sweep_rows, tmp_path):
    # the sweep moves the optimizer's share as the plate says: 15% at 8192 tokens, 2% at 65,536
    shares = dict(zip(sweep_rows["tokens"], sweep_rows["optimizer_time_share"], strict=True))
    assert shares[8192] == pytest.approx(0.15, abs=0.005)
    assert shares[65536] == pytest.approx(0.02, abs=0.005)
    out = tmp_path / "sweep.png"
    plot_sweep(sweep_rows, "tokens", out)
    width, height = png_size(out.read_bytes())
    assert 400 <= width <= 3000 and 300 <= height <= 3000
    plot_sweep(sweep_rows, "batch", tmp_path / "sweep.svg")
    assert "<svg" in (tmp_path / "sweep.svg").read_text()


def test_sweep_plot_bad_input(sweep_rows, tmp_path):
    with pytest.raises(OpgraphError, match="no 'seq' column"):
        plot_sweep(sweep_rows, "seq", tmp_path / "s.png")
    with pytest.raises(OpgraphError, match="time_share"):
        plot_sweep({"tokens": [1, 2], "mfu_ceiling": [0.1, 0.2]}, "tokens", tmp_path / "s.png")
    assert list(tmp_path.iterdir()) == []


def test_cli_plot(tmp_path, capsys):
    out = tmp_path / "plate.png"
    assert main(["profile", "--plot", str(out), "--tokens", "65536"]) == 0
    assert png_size(out.read_bytes())[0] >= 400
    assert "65,536 tokens per step" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["plate.pdf", "missing/plate.png"])
def test_cli_bad_plot_path(tmp_path, capsys, name):
    assert main(["profile", "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("opgraph: error:")
    assert list(tmp_path.iterdir()) == []


def test_without_matplotlib_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    assert main(["profile", "--plot", str(tmp_path / "plate.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "opgraph: error: plotting needs matplotlib: pip install 'opgraph[plot]'"


def test_profile_without_plot_never_imports_matplotlib(tmp_path):
    code = ("import sys; from opgraph.cli import main; main(['profile', '--trace', sys.argv[1]]);"
            " print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.json")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_sweep_plot_from_the_cli(tmp_path, capsys):
    from opgraph.cli import main

    out = tmp_path / "sweep.png"
    assert main(["sweep", "--tokens", "8192:65536:x2", "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 400 and height >= 300
    capsys.readouterr()
    grid = tmp_path / "grid.png"
    assert main(["sweep", "--tokens", "8192:16384:x2", "--seq-len", "4096,8192",
                 "--plot", str(grid)]) == 2
    assert "one swept dimension" in capsys.readouterr().err and not grid.exists()
