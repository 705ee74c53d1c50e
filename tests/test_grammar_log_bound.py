"""The grammar processor's "log once" memory stays bounded.

Its warnings are logged once per distinct message, and a failure message
carries the request's own grammar text: on a server that sees many distinct
bad grammars, remembering every message would grow for the engine's life.
Each distinct message is still logged when it first comes.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.processor_fixtures import processor_fixtures

pytest.importorskip("vllm")
pytest.importorskip("llguidance")

vllm_config, tokenizer = processor_fixtures("model_path", max_model_len=256)


def test_distinct_failures_are_each_logged_in_bounded_memory(vllm_config):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from vllm_plugins.logits_processors import grammar
    from vllm_plugins.logits_processors.log_once import LOG_ONCE_KEYS

    proc = grammar.GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    vocab = vllm_config.model_config.get_vocab_size()
    n = LOG_ONCE_KEYS * 2 + 10
    with mock.patch.object(grammar.logger, "warning") as warn:
        for i in range(n):
            # A grammar validate_params would have refused, as a request from
            # a client that skipped the front end's check: it fails in the worker.
            params = SamplingParams(extra_args={"grammar": {"regex": f"a{i}(b"}})
            proc.update_state(BatchUpdate(batch_size=1, removed=[0] if i else [],
                                          added=[(0, params, [1, 2], [])], moved=[]))
            proc.apply(torch.zeros(1, vocab))
        logged = [c.args[-1] for c in warn.call_args_list]
    # Every distinct message was logged (twice per request: the worker's
    # compile failure, then the forced failure text)...
    assert sum(f"a{n - 1}(b" in str(m) for m in logged) == 2
    assert len(logged) == 2 * n
    # ...and the processor remembers a bounded number of them.
    assert len(proc._logged) <= LOG_ONCE_KEYS
    # A message seen recently is not logged again.
    with mock.patch.object(grammar.logger, "warning") as warn:
        proc._log_once(f"failed:{logged[-1]}", "again %s", logged[-1])
        proc._log_once("asap:v2", "first time %s", "x")
        proc._log_once("asap:v2", "first time %s", "x")
    assert warn.call_count == 1
