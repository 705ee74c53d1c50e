"""What our V2 drafter reads from the runner's samplers.

V2's runner computes the verified rows' logits inside ``sample`` (grammar
masks applied in place) and hands them to its ``Sampler`` (a step without
drafts) or ``RejectionSampler`` (a step with drafts); each request's
sampling parameters reach only ``Sampler.add_request``. A runner whose
drafter is ours gets both samplers wrapped in a ``SamplerTap`` once, after
``load_model`` built them: the tap shows our speculator the logits and the
parameters, then calls vLLM's sampler with the same arguments. Everything
else (attributes, other methods) is the wrapped sampler's own.
"""

from __future__ import annotations


class SamplerTap:
    """Stands in for one of a V2 runner's samplers."""

    def __init__(self, sampler, observer):
        object.__setattr__(self, "_sampler", sampler)
        object.__setattr__(self, "_observer", observer)

    def __call__(self, logits, input_batch, *args, **kwargs):
        # Sampler(logits, input_batch) and RejectionSampler(logits,
        # input_batch, draft_logits, invalid_drafts): the rows in batch order,
        # input_batch.cu_num_logits_np rows per request.
        self._observer.observe_logits(logits, input_batch)
        return self._sampler(logits, input_batch, *args, **kwargs)

    def add_request(self, req_index, sampling_params, *args, **kwargs):
        # Sampler.add_request(req_idx, sampling_params): called for every new
        # request on the last pipeline stage, right after RequestState's.
        self._observer.observe_params(req_index, sampling_params)
        return self._sampler.add_request(req_index, sampling_params, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def __setattr__(self, name, value):
        setattr(self._sampler, name, value)


def tap_samplers(runner, observer) -> None:
    """Wraps the runner's samplers (once); ``observer`` is our speculator."""
    for attr in ("sampler", "rejection_sampler"):
        sampler = getattr(runner, attr, None)
        if sampler is not None and not isinstance(sampler, SamplerTap):
            setattr(runner, attr, SamplerTap(sampler, observer))
