import pytest

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
    assert "| overall | tr | 2.50 | 83.3 | 1.67x | 1/2 |" in md
    assert md.splitlines()[-1] == "| tr | 0.50 |"
    plot(rows, str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_ratio_ci_brackets_the_point_and_narrows_with_agreement():
    from vllm_plugins.bench.report import ratio_ci

    base = [10.0, 11.0, 9.5, 10.5, 10.2, 9.8]
    steady = [5.0, 5.5, 4.75, 5.25, 5.1, 4.9]          # exactly 2x every batch
    point, lo, hi = ratio_ci(base, steady)
    assert point == sum(base) / sum(steady) and lo <= point <= hi
    assert hi - lo < 1e-9
    noisy = [4.0, 7.0, 4.0, 6.5, 4.2, 6.0]
    point2, lo2, hi2 = ratio_ci(base, noisy)
    assert lo2 < point2 < hi2 and hi2 - lo2 > 0.1
    assert ratio_ci([1.0], [2.0])[1] != ratio_ci([1.0], [2.0])[1]   # NaN: one pair


def test_controller_delta_subtracts_counters_and_keeps_the_curve():
    from vllm_plugins.bench.report import controller_delta, controller_markdown

    before = {"policy": "goodput", "steps": 5, "decisions": 10, "zero_choices": 2,
              "k_histogram": [2, 3, 5], "explore_steps": 1, "rest_steps": 1}
    after = {"policy": "goodput", "steps": 25, "decisions": 30, "zero_choices": 12,
             "k_histogram": [12, 3, 15], "explore_steps": 1, "rest_steps": 9,
             "cost_model": {"warm": True, "intercept_s": 0.05, "per_token_s": 0.002,
                            "per_request_s": 0.001, "verify_step_s": 0.006,
                            "new_shape_s": 0.1}}
    d = controller_delta(before, after)
    assert d["decisions"] == 20 and d["zero_choices"] == 10
    assert d["k_histogram"] == [10, 0, 10] and d["mean_k"] == 1.0
    assert d["zero_fraction"] == 0.5 and d["explore_steps"] == 0
    md = controller_markdown([{"batch": 8, "method": "tr", **d}])
    assert ("| 8 | tr | 20 | 50.0% | 1.00 | 10 0 10 | 0 | 8 / 20 | 50.0 ms + 2.00 "
            "ms/token + 1.00 ms/request; verifying +6.0 ms, new size +100.0 ms |") in md


def test_disjoint_sets_never_share_a_prompt():
    from vllm_plugins.bench.data import disjoint_sets, load_questions

    sets, left = disjoint_sets(None, [1, 2, 2])
    ids = [q["question_id"] for s in sets for q in s]
    assert len(ids) == len(set(ids))
    cats = {q["category"] for q in load_questions()}
    assert {q["category"] for q in sets[0]} == cats and len(sets[0]) == len(cats)
    assert len(ids) + len(left) == len(load_questions())
    assert not {q["question_id"] for q in left} & set(ids)


def test_cli_batch_sizes_and_counts():
    import pytest

    from vllm_plugins.bench.cli import parse_args

    a = parse_args(["--batch-sizes", "1,8,16", "--per-category", "1,2,2", "--aa"])
    assert a.batch_sizes == [1, 8, 16] and a.per_category == [1, 2, 2] and a.aa
    assert parse_args([]).batch_sizes == [1]
    assert parse_args(["--batch-size", "4"]).batch_sizes == [4]
    for bad in (["--batch-sizes", "1,8", "--per-category", "1,2,3"],
                ["--batch-sizes", "0,8"], ["--batch-size", "2", "--batch-sizes", "1"],
                ["--mat-only", "--aa"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_cli_runs_every_batch_size_with_fake_engines(tmp_path, monkeypatch):
    """The whole driver (disjoint sets, interleaving, A/A rerun, controller
    deltas, summary files) on stand-in engines: no vLLM model is loaded."""
    import json

    import pytest

    pytest.importorskip("vllm")
    from vllm_plugins.bench import cli, data, engines

    class Tok:
        def apply_chat_template(self, msgs, **kw):
            return msgs[0]["content"]

        def __call__(self, text, **kw):
            return {"input_ids": [1, 2, 3]}

    class Fake:
        def __init__(self, spec):
            self.spec = spec
            self.calls = 0

        def get_tokenizer(self):
            return Tok()

    stats_calls = {}

    def fake_stats(llm):
        if not llm.spec or llm.spec.get("draft_length") != "goodput":
            return {}
        n = stats_calls[id(llm)] = stats_calls.get(id(llm), 0) + 1
        return {"proposer": {"draft_length": {
            "policy": "goodput", "decisions": 10 * n, "zero_choices": 3 * n,
            "k_histogram": [3 * n, 7 * n], "cost_model": {"warm": False}}}}

    def fake_run(llm, prompts, params, in_flight=None):
        llm.calls += 1
        res = [engines.RequestResult([7] * 4, 2 if llm.spec else 4) for _ in prompts]
        return res, 0.1 * len(prompts) * (0.5 if llm.spec else 1.0)

    monkeypatch.setattr(engines, "build_engine", lambda model, spec, **kw: Fake(spec))
    monkeypatch.setattr(engines, "run_batch", fake_run)
    monkeypatch.setattr(engines, "engine_stats", fake_stats)
    monkeypatch.setattr("vllm_plugins.bench.data.render", lambda tok, q: [1, 2, 3])
    out = tmp_path / "o"
    assert cli.main(["--model", "m", "--methods", "none,token_recycling+goodput",
                     "--batch-sizes", "1,2", "--per-category", "1,1", "--aa",
                     "--categories", "qa,rag", "--max-tokens", "4",
                     "--warmup", "1", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    by = {(s["batch"], s["method"]): s for s in summary["summary"]}
    assert by[(1, "token_recycling+goodput")]["speedup"] == 2.0
    assert by[(1, cli.RERUN)]["speedup"] == 1.0
    ctl = {c["batch"]: c for c in summary["controllers"]}
    # the warm-up's counts are not charged to batch 1
    assert ctl[1]["decisions"] == 10 and ctl[2]["zero_choices"] == 3
    assert (out / "speedup.png").exists() and (out / "bench_b2.md").exists()
    rows = [r for r in summary["rows"] if r["method"] == "token_recycling+goodput"]
    assert {r["batch"] for r in rows} == {1, 2} and all(r["MAT"] == 2.0 for r in rows)


class _QueueEngine:
    """An LLMEngine stand-in: request i needs len(prompt_i) steps, one token
    each; records how many ran at once."""

    def __init__(self):
        self.left, self.widths, self.order = {}, [], []

    def add_request(self, rid, prompt, params):
        self.left[rid] = len(prompt["prompt_token_ids"])
        self.order.append(rid)

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        from types import SimpleNamespace as NS

        self.widths.append(len(self.left))
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(NS(request_id=rid, finished=done,
                           outputs=[NS(token_ids=[len(self.order)])]))
        return outs


def test_run_batch_keeps_the_batch_full_from_the_queue():
    from types import SimpleNamespace as NS

    from vllm import SamplingParams

    from vllm_plugins.bench.engines import run_batch

    prompts = [[0] * n for n in (1, 3, 2, 2, 1)]   # steps each request needs
    engine = _QueueEngine()
    res, _ = run_batch(NS(llm_engine=engine), prompts, SamplingParams(), in_flight=2)
    # a finished request is replaced before the next step: 2 in flight until
    # the queue is empty, in prompt order
    assert engine.widths == [2, 2, 2, 2, 1]
    assert [len(r.token_ids) for r in res] == [1, 3, 2, 2, 1]
    assert all(r.forwards == len(r.token_ids) for r in res)
    static = _QueueEngine()
    run_batch(NS(llm_engine=static), prompts, SamplingParams())
    assert static.widths == [5, 3, 1]   # all at once, draining


def test_wide_markdown_one_line_per_category():
    from vllm_plugins.bench.report import wide_markdown

    rows = [{"category": "qa", "method": "none", "MAT": 1.0, "speedup": 1.0, "tok/s": 10.0},
            {"category": "qa", "method": "tr", "MAT": 2.0, "speedup": 1.5, "tok/s": 15.0},
            {"category": "rag", "method": "tr", "MAT": 3.0, "speedup": None, "tok/s": 9.0}]
    md = wide_markdown(rows).splitlines()
    assert md[0] == "| category | none tok/s | tr MAT / speedup |"
    assert md[2] == "| qa | 10.0 | 2.00 / 1.50x |" and md[3] == "| rag |  | 3.00 / - |"


def test_markdown_leaves_out_columns_without_values():
    from vllm_plugins.bench.report import markdown

    row = {"category": "qa", "method": "tr", "MAT": 2.0, "acceptance": None,
           "tok/s": 5.0, "speedup": None, "mismatches": None, "requests": 3}
    assert markdown([row]).splitlines() == [
        "| category | method | MAT | tok/s |", "|---|---|---:|---:|", "| qa | tr | 2.00 | 5.0 |"]


def test_queue_units_are_even_and_static_batches_unchanged():
    from vllm_plugins.bench.cli import _units

    units, in_flight = _units(list(range(76)), 16, 2)
    assert in_flight == 16 and [len(u) for u in units] == [25, 25, 26]
    assert sum(units, []) == list(range(76))
    units, in_flight = _units(list(range(26)), 16, 1)
    assert in_flight is None and [len(u) for u in units] == [16, 10]
    units, in_flight = _units(list(range(5)), 1, 2)
    assert in_flight is None and [len(u) for u in units] == [1] * 5


def test_step_costs_groups_by_count_and_what_was_verified():
    from vllm_plugins.bench.step_costs import (CHAIN, NONE, TREE, StepRecord, parse_args,
                                               summarize, table, verified_shape)

    assert verified_shape([-1, 0, 0], 0) == NONE
    assert verified_shape(None, 3) == CHAIN
    assert verified_shape([-1, 0, 0], 2) == CHAIN      # the verified prefix is a chain
    assert verified_shape([-1, 0, 0], 3) == TREE
    records = [StepRecord(CHAIN, 1, NONE, 0.100, 0.0), StepRecord(TREE, 1, NONE, 0.102, 0.0),
               StepRecord(CHAIN, 4, CHAIN, 0.120, 0.0), StepRecord(CHAIN, 4, CHAIN, 0.130, 0.0),
               StepRecord(CHAIN, 4, CHAIN, 0.500, 0.0), StepRecord(TREE, 4, TREE, 0.140, 0.0),
               StepRecord(TREE, 4, TREE, 0.150, 0.0), StepRecord(TREE, 4, TREE, 0.145, 0.0),
               StepRecord(TREE, 9, TREE, 0.200, 0.0)]
    rows = {r["tokens"]: r for r in summarize(records)}
    assert rows[1]["none_steps"] == 2 and abs(rows[1]["none_ms"] - 101.0) < 1e-9
    assert rows[4]["chain_steps"] == 3 and abs(rows[4]["chain_ms"] - 130.0) < 1e-9  # median
    assert abs(rows[4]["tree_ms"] - 145.0) < 1e-9
    assert abs(rows[4]["tree_extra_ms"] - 15.0) < 1e-9
    assert rows[9]["tree_extra_ms"] is None and rows[9]["chain_ms"] is None
    text = table(list(rows.values()), min_steps=2)
    assert "| 4 |  | 3, 130.0 | 3, 145.0 | 15.0 |" in text
    assert "| 9 |" not in text                          # one step: below min_steps
    with pytest.raises(SystemExit):
        parse_args(["--nodes", "0"])
