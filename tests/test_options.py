"""One option system: every method's and every draft-length policy's options
declared with vllm_plugins.options, bounded, and refused at start-up with
one error that names the option."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from vllm_plugins.options import TABLE_MEMORY_CEILING_BYTES, resolve
from vllm_plugins.proposers.draft_length import CONTROLLERS, policy_options
from vllm_plugins.registry import MAX_NUM_SPECULATIVE_TOKENS, METHODS, translate

# Recorded before the two option systems became one (the goodput option
# switch_cost is now verify_step_cost).
DEFAULTS = Path(__file__).parent / "data" / "option_defaults.json"


def _declared():
    """(kind, owner, options) of every method and every policy."""
    for name, method in METHODS.items():
        yield "method", name, method.proposer_class().OPTIONS
    for name, cls in CONTROLLERS.items():
        yield "policy", name, cls.OPTIONS


def _sizes():
    """Every integer option but seeds: each sizes something, so each states
    an upper bound."""
    for kind, owner, options in _declared():
        for o in options:
            if o.kind is int and o.choices is None and o.name != "seed":
                yield kind, owner, o


def test_defaults_are_unchanged():
    recorded = json.loads(DEFAULTS.read_text())
    now = {name: resolve(name, m.proposer_class().OPTIONS, {})
           for name, m in METHODS.items()}
    now.update({f"policy:{p}": policy_options(p, None) for p in CONTROLLERS})
    assert json.loads(json.dumps(now, sort_keys=True, default=str)) == recorded


def test_every_size_option_states_an_upper_bound():
    sizes = list(_sizes())
    assert len(sizes) >= 20
    missing = [(kind, owner, o.name) for kind, owner, o in sizes if o.upper is None]
    assert not missing
    for _, _, o in sizes:
        assert str(o.upper) in o.rule, (o.name, o.rule)   # stated, not only checked


# Options whose bound is only valid beside another's (rules between options).
COMPANIONS = {"prompt_lookup_min": {"prompt_lookup_max": 4096}}


@pytest.mark.parametrize("kind,owner,option", list(_sizes()),
                         ids=lambda v: getattr(v, "name", v))
def test_each_bound_is_refused_naming_the_option(kind, owner, option):
    if kind == "method":
        with pytest.raises(ValueError, match=f"'{option.name}' of method '{owner}'"):
            translate({"method": owner, option.name: option.upper + 1})
        if option.table_bytes is None:   # the bound itself is accepted
            spec = {"method": owner, option.name: option.upper,
                    **COMPANIONS.get(option.name, {})}
            assert translate(spec)[1][option.name] == option.upper
    else:
        with pytest.raises(ValueError, match=f"'{option.name}' of policy '{owner}'"):
            policy_options(owner, {option.name: option.upper + 1})
        assert policy_options(owner, {option.name: option.upper})[option.name] == option.upper


@pytest.mark.parametrize("method,option,value", [
    ("token_recycling", "context_slots", 1 << 30),
    ("stand", "max_entries", 1 << 26),
])
def test_tables_over_the_memory_ceiling_are_refused_at_start_up(method, option, value):
    with pytest.raises(ValueError, match=f"'{option}' of method '{method}'") as e:
        translate({"method": method, option: value})
    nbytes = int(str(e.value).split("allocate ")[1].split(" bytes")[0])
    assert nbytes > TABLE_MEMORY_CEILING_BYTES
    # The defaults sit far below the ceiling.
    translate({"method": method})


def test_token_recycling_table_bytes_follow_its_memory_statement():
    opts = resolve("token_recycling", METHODS["token_recycling"].proposer_class().OPTIONS,
                   {"context_slots": 1 << 20})
    slots = {o.name: o for o in METHODS["token_recycling"].proposer_class().OPTIONS}
    assert slots["context_slots"].table_bytes(opts) == 16 << 20    # 16 MiB (docstring)
    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

    p = TokenRecyclingProposer(options={"context_slots": 1 << 12}, vocab_size=64)
    t = p.tables
    assert t.ctx_key.nbytes + t.ctx_tok.nbytes + t.ctx_logp.nbytes == 16 << 12


def test_max_num_speculative_tokens_is_vllms_rejection_sampler_limit():
    """vllm/v1/sample/rejection_sampler.py: MAX_SPEC_LEN, asserted against
    each step's longest draft (read from the source: importing the module
    loads its kernels)."""
    path = importlib.util.find_spec("vllm.v1.sample.rejection_sampler").origin
    tree = ast.parse(Path(path).read_text())
    values = [node.value.value for node in tree.body
              if isinstance(node, ast.Assign)
              and any(getattr(t, "id", None) == "MAX_SPEC_LEN" for t in node.targets)]
    assert values == [MAX_NUM_SPECULATIVE_TOKENS]
    assert "max_spec_len <= MAX_SPEC_LEN" in Path(path).read_text()


@pytest.mark.parametrize("value", [0, -1, MAX_NUM_SPECULATIVE_TOKENS + 1, 1000, True, 2.0])
def test_num_speculative_tokens_out_of_range_is_refused(value):
    for method in METHODS:
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            translate({"method": method, "num_speculative_tokens": value})


def test_num_speculative_tokens_within_range_is_passed_on():
    for value in (1, MAX_NUM_SPECULATIVE_TOKENS):
        fields, options = translate({"method": "token_recycling",
                                     "num_speculative_tokens": value})
        assert fields["num_speculative_tokens"] == value and options is not None


def test_policy_options_errors_name_the_option_and_the_policy():
    with pytest.raises(ValueError, match="draft_length option 'half_life' of policy 'goodput'"):
        policy_options("goodput", {"half_life": 0})
    with pytest.raises(ValueError, match=r"unknown draft_length option\(s\) \['nope'\]"):
        policy_options("acceptance", {"nope": 1})
    with pytest.raises(ValueError, match="'half_life' of policy 'goodput'"):
        translate({"method": "token_recycling", "draft_length_options": {"half_life": -1}})
    with pytest.raises(ValueError, match="'draft_length' of method 'stand'"):
        translate({"method": "stand", "draft_length": "always"})


def test_a_method_declaring_its_own_options_still_takes_the_draft_length_ones():
    from vllm_plugins.options import positive_int
    from vllm_plugins.proposers.base import PluginProposer

    class Outside(PluginProposer):
        OPTIONS = (positive_int("depth", 2, 8),)

    p = Outside(None, {"depth": 3, "draft_length": "acceptance"}, vocab_size=8)
    assert p.options["depth"] == 3 and p.controller.name == "acceptance"
    assert Outside(None, {}, vocab_size=8).controller is None    # "fixed"
    with pytest.raises(ValueError, match="'depth' of method 'Outside'"):
        Outside(None, {"depth": 9}, vocab_size=8)
