"""`Engine.generate`, the offline call: submit every prompt as the queue allows, step until
each has ended, and hand back their completions in order (vLLM's `LLM.generate`)."""

import jax


def run_to_end(engine, prompts, configs, keys, constraints) -> list:
    """`engine.generate(prompts, configs, keys=keys, constraints=constraints)` (see it)."""
    prompts = list(prompts)
    configs = list(configs) if isinstance(configs, (list, tuple)) else [configs] * len(prompts)
    keys = [jax.random.key(i) for i in range(len(prompts))] if keys is None else list(keys)
    constraints = [None] * len(prompts) if constraints is None else list(constraints)
    if not (len(configs) == len(keys) == len(constraints) == len(prompts)):
        raise ValueError(
            f"{len(prompts)} prompts need as many configs, keys and constraints, got {len(configs)} "
            f"configs, {len(keys)} keys and {len(constraints)} constraints."
        )
    ids, queue = [], list(range(len(prompts)))[::-1]
    while queue or engine.has_work():
        while queue and len(engine.scheduler.waiting) < engine.max_waiting:
            i = queue.pop()
            ids.append(engine.submit(prompts[i], configs[i], key=keys[i], constraint=constraints[i]))
            engine._kept[ids[-1]] = None
        engine.step()
    results = []
    for request_id in ids:
        request = engine._kept.pop(request_id)
        done = [s.completion() for s in request.sequences]
        results.append(done if request.config.num_samples is not None else done[0])
    return results
