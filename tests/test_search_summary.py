"""search_summary's figures agree with verify_rules' search table on the committed rows (both read the
same rows; a change in either one's reading shows here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from page_local.eval.rows import read_rows
from page_local.eval.search_summary import main, summary
from page_local.eval.verify_rules import search_recorded

ROWS = Path(__file__).resolve().parent.parent / "docs" / "results-search-qwen-2048" / "rows.jsonl.gz"


@pytest.fixture(scope="module")
def rows():
    return read_rows(ROWS)


@pytest.mark.parametrize("evictor", ["snapkv", "lorekv-answer"])
def test_search_lines_are_verify_rules_lines(rows, evictor):
    mine = summary(rows)[evictor]["search"]
    ref = search_recorded(rows, evictor)["search"]
    assert (mine["lost"], mine["right"]) == (ref["lost"], ref["right"])
    assert mine["mean"] == pytest.approx(ref["compression"]) and mine["median"] == pytest.approx(ref["median_compression"])
    assert mine["forced_smallest_first"] == pytest.approx(ref["forced"])
    assert mine["forced_one_batch"] >= mine["forced_smallest_first"] > 0
    assert mine["evicted"] == round(ref["evicted"] * mine["n"])


def test_the_cli_prints_one_search_line_per_evictor(rows, capsys):
    s = summary(rows)
    assert "always" in s["snapkv"] and "always" not in s["lorekv-answer"]  # that evictor runs only under a check
    main([str(ROWS)])
    out = capsys.readouterr().out
    assert out.count("search: lost") == 2 and "x SnapKV verify at 0.25" in out


def test_a_missing_rows_file_is_said_as_such(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nope.jsonl")])
    assert e.value.code == 2 and "no such rows file" in capsys.readouterr().err
