"""The loop wing of `dropless.train`: setting a run up, the training loop and its guard,
preemption, multi-process runs, optimiser-state offload, metrics and callbacks, throughput, the
opened data, and what a run does after its last step.

It sits on top of the other wings (step, plan, store) and `dropless.sharding`."""
