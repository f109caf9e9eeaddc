"""The files of a run directory, by name: what `train` writes into `out_dir` and `load_run`,
`dropless evaluate` and `dropless generate` read back."""

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
# In a prepared data directory: the tokenizer a run's data was encoded with.
TOKENIZER_FILE = "tokenizer.json"

# What config.yaml records for a `Backend` value that has no name (`dropless.train.BACKENDS`).
CUSTOM_BACKEND = "custom"

# `TrainConfig.data` values that name a built-in corpus rather than a prepared directory.
STDLIB, SYNTHETIC = "stdlib", "synthetic"
