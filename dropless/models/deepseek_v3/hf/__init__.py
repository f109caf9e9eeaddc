"""Hugging Face DeepSeek-V2/V3 checkpoints: reading and writing them, and the mapping between
dropless parameter paths and Hugging Face tensor names.

- `_files`: config.json, safetensors headers and memory-mapped data, FP8 block dequantisation.
- `_mxfp4`: gpt-oss's MXFP4 experts (`dequantize_mxfp4`).
- `_names`: which checkpoint tensor fills which part of which parameter (`hf_names`,
  `dropless_names`; the table behind both directions).
- `_load`: `from_pretrained` and `config_from_pretrained`.
- `_save`: `save_pretrained` and `to_hf` (the same tensors in memory).
"""

from dropless.models.deepseek_v3.hf._files import CheckpointError, dequantize_fp8, iter_checkpoint
from dropless.models.deepseek_v3.hf._load import config_from_pretrained, from_pretrained
from dropless.models.deepseek_v3.hf._mxfp4 import dequantize_mxfp4
from dropless.models.deepseek_v3.hf._names import dropless_names, hf_names
from dropless.models.deepseek_v3.hf._save import save_pretrained, to_hf

__all__ = [
    "CheckpointError",
    "config_from_pretrained",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "dropless_names",
    "from_pretrained",
    "hf_names",
    "iter_checkpoint",
    "save_pretrained",
    "to_hf",
]
