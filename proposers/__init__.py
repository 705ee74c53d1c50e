"""Speculative proposers served through vLLM's custom_class route."""
