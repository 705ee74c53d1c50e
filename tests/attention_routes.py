"""What of a worker's runner carries the tree route (bridge/v1/runner.py:
``route_trees``), for engine tests: a chain engine must keep vLLM's methods
and attention as they are, a tree engine must route all of them. Called
through ``LLM.collective_rpc`` on an in-process engine."""


def tree_routes(worker) -> dict:
    """The runner's attention layers, how many the tree route holds ready
    (put on them for a tree step's forward alone: between steps none carries
    a wrapper of ours), and which of the runner's own tree patches it
    carries."""
    from vllm_plugins.bridge.patches import named
    from vllm_plugins.bridge.patching import applied_to
    from vllm_plugins.bridge.state import state_of
    from vllm_plugins.bridge.v1.runner import ATTENTION_TREE_ROUTE, RUNNER_TREE_ROUTE

    runner = worker.model_runner
    attention = named(ATTENTION_TREE_ROUTE)
    owner, attr = attention.owner_and_attr()
    impls = [m.impl for m in runner.get_model().modules()
             if isinstance(getattr(m, "impl", None), owner)]
    assert not any(attr in vars(i) for i in impls)
    state = state_of(runner)
    held = state.tree_attention if state is not None else None
    ready = set() if held is None else {id(obj) for obj in held.objects}
    assert held is None or held.patch is attention
    return {"layers": len(impls), "routed_layers": sum(id(i) in ready for i in impls),
            "runner": [n for n in RUNNER_TREE_ROUTE if applied_to(named(n), runner)]}
