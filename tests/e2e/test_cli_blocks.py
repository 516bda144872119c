"""``attncomp blocks``: the tile classes of ``fn.block_map`` as a text grid, and as a PNG."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from attncomp.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CAUSAL = f"{EXAMPLES / 'causal.py'}:causal"
WINDOW = f"{EXAMPLES / 'sliding_window.py'}:causal_sliding_window"
PADDING = f"{EXAMPLES / 'padding.py'}:key_padding"
DIMS = "B=1,H=2,T=256,S=256,D=8,E=8"


def grid_lines(out: str) -> list[str]:
    """The grid: the lines after the one that says which batch entry and head it shows."""
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.endswith("query blocks down, key blocks across"))
    return [line for line in lines[start + 1 :] if line and not line.startswith("wrote ")]


def test_help_lists_blocks(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+blocks\s+print which tiles are skipped, masked or full", capsys.readouterr().out, re.M)


def test_causal_grid_is_lower_triangular_with_masked_diagonal(capsys):
    assert main(["blocks", CAUSAL, "--dims", DIMS]) == 0
    out = capsys.readouterr().out
    assert grid_lines(out) == ["m...", "#m..", "##m.", "###m"]
    assert "blocks: 64 queries x 64 keys" in out
    # two heads of 4 x 4 tiles: 2 x (6 skipped, 4 masked, 6 full)
    assert "tiles: 12 skipped (.), 8 masked (m), 12 full (#); 62.5% computed" in out
    assert "batch 0, head 0:" in out


def test_block_sizes_follow_the_pipeline(capsys):
    pipeline = "softmax-fusion,flash-tiling{block_q=32,block_k=128},mask-elimination"
    assert main(["blocks", CAUSAL, "--dims", DIMS, "--pipeline", pipeline]) == 0
    out = capsys.readouterr().out
    assert "blocks: 32 queries x 128 keys" in out
    assert grid_lines(out) == ["m.", "m.", "m.", "m.", "#m", "#m", "#m", "#m"]


def test_constants_and_skipped_tiles_of_a_window(capsys):
    assert main(["blocks", WINDOW, "--dims", "B=1,H=1,T=320,S=320,D=8,E=8", "--const", "window=64"]) == 0
    out = capsys.readouterr().out
    # keys i-63 .. i: the diagonal tile and the one before it, each partly masked
    assert grid_lines(out) == ["m....", "mm...", ".mm..", "..mm.", "...mm"]


def test_batch_and_head_choose_the_grid(capsys):
    assert main(["blocks", PADDING, "--dims", "B=3,H=2,T=128,S=256,D=8,E=8", "--batch", "2", "--head", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 2, head 1:" in out
    assert len(grid_lines(out)) == 2
    assert all(len(line) == 4 for line in grid_lines(out))


def test_png_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "tiles.png"
    assert main(["blocks", CAUSAL, "--dims", DIMS, "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in capsys.readouterr().out


def test_png_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "tiles.png"
    assert main(["blocks", CAUSAL, "--dims", DIMS, "--png", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == "attncomp: error: attncomp blocks --png needs matplotlib: pip install 'attncomp[plot]'\n"
    assert captured.out == ""
    assert not path.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dims", "B=1,H=1,T=64"], "--dims: give sizes for D, E, S"),
        (["--dims", DIMS, "--head", "2"], "--head 2: the block map has 2 along head"),
        (["--dims", DIMS, "--batch", "-1"], "--batch -1: the block map has 1 along batch"),
        (["--dims", DIMS, "--pipeline", "softmax-fusion"], "block_map needs tiled attention"),
        (["--dims", "B=one"], "--dims: expected NAME=INT, got 'B=one'"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    assert main(["blocks", CAUSAL, *argv]) == 2
    assert message in capsys.readouterr().err
