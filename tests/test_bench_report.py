from vllm_plugins.bench.report import Tally, markdown, plot


def test_table_and_plot(tmp_path):
    t = Tally()
    t.add("none", "qa", 100, 100, 2.0, False)
    t.add("tr", "qa", 100, 40, 1.0, False)
    t.add("none", "rag", 50, 50, 1.0, False)
    t.add("tr", "rag", 50, 20, 0.8, True)
    rows = t.table(["none", "tr"], ["qa", "rag"], {"none": None, "tr": 0.5})
    by = {(r["category"], r["method"]): r for r in rows}
    assert by[("qa", "tr")]["MAT"] == 2.5
    assert by[("qa", "tr")]["speedup"] == 2.0
    assert by[("overall", "tr")]["MAT"] == 150 / 60
    assert by[("overall", "tr")]["mismatches"] == 1
    assert by[("overall", "tr")]["acceptance"] == 0.5
    md = markdown(rows)
    assert "| overall | tr | 2.50 | 0.50 |" in md
    plot(rows, str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").stat().st_size > 1000
