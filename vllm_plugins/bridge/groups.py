"""Which requests sample one prompt, from vLLM's request ids (both runners'
``StepContext``: ``v1/step.py`` and ``v2/context.py``)."""

from __future__ import annotations


def group_of(req_id: str, sampling_params) -> str:
    """Samples of one prompt share a group: vLLM names n>1 children 'i_parent'."""
    head, sep, tail = req_id.partition("_")
    if sep and head.isdigit() and getattr(sampling_params, "n", 1) == 1 and tail:
        return tail
    return req_id
