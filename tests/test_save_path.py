"""``save_path``: in a multi-rank engine only the first rank writes the file.

Two real processes in one torch.distributed (gloo) world, as vLLM's workers
are, each with tables of its own; after both exit, the file holds rank 0's.
"""

import multiprocessing as mp
import os
import time

import numpy as np

V = 64


def _rank(rank: int, world: int, init_file: str, path: str) -> None:
    import torch.distributed as dist

    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

    dist.init_process_group("gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    p = TokenRecyclingProposer(None, {"save_path": path, "context_order": 1,
                                      "topk": 2}, vocab_size=V)
    p.load_model(None)
    p.tables.ids[:] = rank + 1  # what this rank would save
    dist.barrier()
    dist.destroy_process_group()  # vLLM tears the world down before exit too
    if rank > 0:  # exit after rank 0 has saved: a later write would replace it
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)


def test_only_the_first_rank_writes_save_path(tmp_path):
    path = str(tmp_path / "tables.npz")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "init"), path))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with np.load(path) as f:
        assert (f["ids"] == 1).all()  # rank 0's tables, written once
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp.npz")]


def test_a_single_process_saves_at_exit(tmp_path):
    path = str(tmp_path / "tables.npz")
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_single, args=(path,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    with np.load(path) as f:
        assert (f["ids"] == 7).all()


def _single(path: str) -> None:
    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

    p = TokenRecyclingProposer(None, {"save_path": path, "context_order": 1,
                                      "topk": 2}, vocab_size=V)
    p.load_model(None)
    p.tables.ids[:] = 7
