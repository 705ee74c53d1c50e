"""Triton kernels, each with a torch twin; the torch path runs on CPU."""
