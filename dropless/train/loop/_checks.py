"""The settings `train` refuses before anything is written: a sequence longer than the model
supports or no longer than the MTP depth, bf16 master weights over a bf16 model, cuDNN attention
off a GPU, an expert-parallel backend without a mesh; and a warning for a warmup longer than
the run."""

import warnings

import jax
from jax.sharding import Mesh

from dropless.backends import Backend
from dropless.models.deepseek_v3 import DeepSeekV3Config
from dropless.train._config import TrainConfig


def validate(model_config: DeepSeekV3Config, train_config: TrainConfig) -> None:
    """Raises ValueError for settings this model or machine cannot run; warns about a warmup
    longer than the run."""
    if train_config.seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"seq_len ({train_config.seq_len}) is longer than the model supports "
            f"(max_position_embeddings = {model_config.max_position_embeddings})"
        )
    depth = model_config.num_nextn_predict_layers
    if depth and train_config.seq_len <= depth:
        raise ValueError(
            f"seq_len ({train_config.seq_len}) must exceed the MTP depth "
            f"(num_nextn_predict_layers = {depth})"
        )
    if train_config.warmup_steps > train_config.steps:
        warnings.warn(
            f"TrainConfig.warmup_steps ({train_config.warmup_steps}) > steps "
            f"({train_config.steps}): the learning rate never reaches lr ({train_config.lr:g})",
            stacklevel=4,
        )
    if train_config.weight_dtype != "float32" and model_config.param_dtype != "float32":
        raise ValueError(
            f"TrainConfig.weight_dtype = {train_config.weight_dtype!r} keeps float32 master "
            f"weights beside the model's, so the model's param_dtype must be 'float32' (got "
            f"{model_config.param_dtype!r})"
        )
    platform = jax.devices()[0].platform
    if model_config.attention_impl == "cudnn" and platform != "gpu":
        raise ValueError(
            "DeepSeekV3Config.attention_impl = 'cudnn' needs an NVIDIA GPU (cuDNN's fused "
            f"attention); JAX runs on {platform} here: use 'xla'"
        )


def check_backend_fits_mesh(name: str, backend: Backend, mesh: Mesh | None) -> None:
    """An expert-parallel backend runs only inside a mesh: refuse it without one, before
    anything is written."""
    if backend.expert_parallel and mesh is None:
        raise ValueError(
            f"backend {name!r} is expert-parallel and needs a device mesh: give "
            "TrainConfig.mesh (--mesh expert=N, N dividing the device count; on a CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N emulates N devices), or a "
            "single-device backend such as 'auto'"
        )
