"""The run-storage wing of `dropless.train`: checkpoints and their digests, files replaced
atomically, the run directory's lock, resuming, the compile cache, and a trained run loaded back.

It imports the step wing, not the loop."""
