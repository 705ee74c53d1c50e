"""How many of a worker's attention layers carry the tree route (patch
``tree.cpu_attention``), for engine tests: a chain engine must keep vLLM's
attention as it is, a tree engine must route every layer. Called through
``LLM.collective_rpc`` on an in-process engine."""


def tree_routes(worker) -> tuple[int, int]:
    """(attention layers, layers whose forward is our tree route)."""
    from vllm_plugins.bridge.patches import named
    from vllm_plugins.bridge.patching import applied_to

    patch = named("tree.cpu_attention")
    owner, attr = patch.owner_and_attr()
    impls = [m.impl for m in worker.model_runner.get_model().modules()
             if isinstance(getattr(m, "impl", None), owner)]
    assert not any(attr in vars(i) and not applied_to(patch, i) for i in impls)
    return len(impls), sum(applied_to(patch, i) for i in impls)
