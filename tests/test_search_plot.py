"""The compression-vs-harm points (eval/search_plot.py) agree with verify_rules' search table on the
committed Qwen rows, and the plot is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from page_local.eval.rows import read_rows
from page_local.eval.search_plot import main, points
from page_local.eval.verify_rules import search_recorded

ROWS = Path(__file__).resolve().parents[1] / "docs" / "results-search-qwen-2048" / "rows.jsonl.gz"


@pytest.fixture(scope="module")
def rows():
    return read_rows(ROWS)


def test_search_and_verify_points_are_verify_rules_lines(rows):
    pts = {(p["gate"], p["budget"]): p for p in points(rows)}
    table = search_recorded(rows)
    s = pts[("search", "ladder")]
    assert s["compression"] == pytest.approx(table["search"]["compression"])
    assert (s["lost"], s["right"], s["n"]) == (table["search"]["lost"], table["search"]["right"], table["search"]["n"])
    for b, line in table["fixed"].items():
        assert pts[("verify", b)]["compression"] == pytest.approx(line["compression"])
        assert pts[("verify", b)]["lost"] == line["lost"]


def test_plain_loses_what_the_rows_say_and_page_never_opens_on_qwen(rows):
    pts = {(p["gate"], p["budget"]): p for p in points(rows)}
    full = {(r["task"], r["index"]): r["correct"] for r in rows if r["gate"] == "full"}
    plain = [r for r in rows if r["gate"] == "always" and r["budget"] == 0.5]
    assert pts[("plain", 0.5)]["lost"] == sum(1 for r in plain if full[(r["task"], r["index"])] and not r["correct"]) > 0
    assert pts[("PAGE", 0.5)]["compression"] == 1.0  # the raw gate opened on no Qwen input (as in every Qwen run)
    assert pts[("plain", 0.0625)]["compression"] > pts[("plain", 0.5)]["compression"]


def test_the_plot_is_written(tmp_path, capsys):
    out = tmp_path / "plot.png"
    main(["--out", str(out), f"Qwen={ROWS}", f"Qwen again={ROWS}:snapkv"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--out", str(out), f"Qwen={ROWS}:no-such-evictor"])
