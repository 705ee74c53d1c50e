"""The host-time profile: every component's functions are found and timed,
a renamed one stops the command, and a run on the tiny model reports time
for every component a method passes through."""

from __future__ import annotations

import json

import pytest

from tests.tiny_model import tiny_llama
from vllm_plugins.bench import host_profile


def test_every_component_is_found_and_unwrapped_after():
    import vllm_plugins.bridge as bridge
    from vllm_plugins.proposers.base import PluginProposer

    from vllm_plugins.bridge.patches import named

    bridge.install()
    step = PluginProposer.step
    # A per-instance patch is timed on the objects it goes onto while the
    # profile is installed.
    attention = named("tree.cpu_attention")
    route = attention.replacement()
    prof = host_profile.Profile()
    prof.install()
    try:
        assert PluginProposer.step is not step
        assert PluginProposer.step.__wrapped__ is step
        assert attention.replacement().__wrapped__ is route and attention.is_applied()
    finally:
        prof.uninstall()
    assert PluginProposer.step is step
    assert attention.replacement() is route


def test_a_renamed_function_stops_the_profile_naming_it(monkeypatch):
    from vllm_plugins.proposers.sources.merge import Merger

    monkeypatch.delattr(Merger, "merge_step")
    before = {k: v for k, v in vars(host_profile.resolve(
        "vllm_plugins.proposers.base:PluginProposer.step")[0]).items()}
    with pytest.raises(RuntimeError, match="Merger.merge_step"):
        host_profile.Profile().install()
    from vllm_plugins.proposers.base import PluginProposer
    assert vars(PluginProposer) == before          # nothing left wrapped


def test_own_time_excludes_wrapped_callees():
    ticks = iter(range(100))
    prof = host_profile.Profile(clock=lambda: float(next(ticks)))

    inner = prof.timed("inner", lambda: None)
    outer = prof.timed("outer", lambda: inner())
    prof.on = True
    outer()
    # clock reads: outer start 0, inner start 1, inner end 2, outer end 3
    assert prof.own == {"inner": 1.0, "outer": 2.0}


# Every source, fixed draft lengths, no confidence floor, every source on:
# the tiny model's flat logits would stop Token Recycling's trees at the
# floor, a draft-length policy would soon stop drafting what it never
# accepts, and sources that bring nothing would be switched off.
ALL_SOURCES = ('all_sources={"method": "hybrid", "draft_length": "fixed", '
               '"source_costs": false, '
               '"sources": ["token_recycling", "suffix", "ngram", "stand"], '
               '"source_options": {"token_recycling": {"min_confidence": 0}}}')


@pytest.mark.slow
def test_a_run_on_the_tiny_model_reports_every_component(tmp_path, capsys):
    from vllm_plugins.bench.engines import suffix_available

    model = tiny_llama(tmp_path / "tiny", num_layers=2)
    methods = ["token_recycling"] + (["suffix"] if suffix_available() else [])
    out = tmp_path / "rows.json"
    assert host_profile.main(["--model", model, "--methods", ",".join(methods),
                              "--extra", ALL_SOURCES, "--batch-sizes", "1",
                              "--prompts", "1", "--max-tokens", "32",
                              "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    for label in host_profile.labels():
        assert f"| {label} |" in printed, label
    # The hybrid's trees pass through every component of ours but the
    # draft-length policy, which Token Recycling's default runs, and V2's
    # device route.
    calls = rows["all_sources"]["calls_per_step"]
    skip = {host_profile.CONTROLLER, host_profile.SUFFIX, host_profile.DEVICE_ROUTE}
    missing = [k for k in host_profile.labels() if k not in skip and not calls.get(k)]
    assert not missing, missing
    assert rows["token_recycling"]["calls_per_step"].get(host_profile.CONTROLLER)
    assert rows["all_sources"]["ours_ms"] > 0 and rows["all_sources"]["steps"] > 0
    if "suffix" in rows:
        assert rows["suffix"]["calls_per_step"].get(host_profile.SUFFIX)
