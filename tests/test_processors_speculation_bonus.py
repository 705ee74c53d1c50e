"""A bonus row masked after drafts that no row was filled for, without an
engine: the engine case (dev schema calculate_area_b345a52d, SmolLM2's
tokens) where the bonus row after ``"width": 10`` allowed a comma that
the grammar forbids there (``width`` is the object's last property), after
an earlier step had verified drafts down another key. Every row of every
step must carry plain decoding's mask.
"""

from __future__ import annotations

import torch

from tests.test_processors_speculation import (  # noqa: F401  (module fixtures)
    built, model_path, params, plain_row, spec_config, tokenizer, vllm_config)
from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

NUMBER = {"type": "number"}
SCHEMA = {"type": "object", "required": ["shape", "dimensions"],
          "properties": {"dimensions": {"type": "object", "properties": {
              "base": NUMBER, "height": NUMBER, "length": NUMBER, "radius": NUMBER,
              "width": NUMBER}}, "shape": {"type": "string"}}}


def test_bonus_row_after_drafts_matches_plain_decoding(spec_config, tokenizer):
    ids = tokenizer.encode('{\n  "dimensions": {\n    "width": 10', add_special_tokens=False)
    other_key = tokenizer.encode("length", add_special_tokens=False)  # after ' "'
    sp = params(extra_args={"grammar": {"json_schema": SCHEMA}})
    output: list[int] = []
    procs = built(spec_config, [(sp, output)])
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    vocab = spec_config.model_config.get_vocab_size()
    # (drafts, tokens the step emits): the engine's steps, in order.
    steps = [([], ids[:1]), (ids[1:7], ids[1:8]),
             (other_key + ids[9:13] + ids[1:2], ids[8:9]), ([], ids[9:10]),
             (ids[10:13], [])]
    assert len(other_key) == 1 and len(ids) == 13
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    for draft, emitted in steps:
        if draft:
            proc.begin_verification([draft])
            try:
                bonus = proc.apply(torch.zeros(1, vocab))
                target = proc.apply_drafted(torch.zeros(len(draft), vocab), [len(draft)])
            finally:
                proc.end_verification()
            rows = list(target) + [bonus[0]]
        else:
            rows = [proc.apply(torch.zeros(1, vocab))[0]]
        for j, row in enumerate(rows):
            ref = plain_row(spec_config, sp, output + draft[:j], torch.zeros(vocab))
            if j and not torch.isfinite(ref).any():
                break
            if all(torch.isfinite(plain_row(spec_config, sp, output + draft[:k],
                                            torch.zeros(vocab))[draft[k]])
                   for k in range(j)):
                assert torch.equal(torch.isfinite(row), torch.isfinite(ref)), (draft, j)
        output.extend(emitted)
    # The last bonus row: after '"width": 10' no comma.
    assert not torch.isfinite(rows[-1][comma])
