"""The planning wing of `dropless.train`: per-device memory, FLOPs and all-to-all traffic of a
training step on a mesh, without allocating the model (`dropless plan`).

It imports the step wing and `dropless.sharding`, not the loop or run storage."""
