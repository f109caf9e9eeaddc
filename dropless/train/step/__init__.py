"""The step wing of `dropless.train`: the loss (next-token cross-entropy plus the MoE terms),
gradient accumulation, the optimiser, and the jitted train and eval steps on one device and on
a device mesh.

It imports `dropless.train.config` and the layers below `dropless.train`, nothing else of it."""
