"""The state `train` starts from: a fresh one (sharded on a mesh), or, when resuming, the
latest intact checkpoint restored into its abstract form; and the checkpointer it saves with."""

import jax
from jax.sharding import Mesh

from dropless.backends import Backend
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from dropless.train._config import TrainConfig
from dropless.train.step._sharded_state import abstract_sharded_state, init_sharded_state
from dropless.train.step._step import TrainState, init_state, with_config
from dropless.train.store._checkpoint import Checkpointer, CheckpointError, open_for_resume
from dropless.train.store._resume import restore_intact


def open_checkpoints(
    directory: str, fresh: TrainState, train_config: TrainConfig, data: dict
) -> tuple[TrainState, Checkpointer]:
    """The state to start from (restored when resuming) and the checkpointer to save with."""
    keep = train_config.keep_checkpoints
    if not train_config.resume:
        checkpointer = Checkpointer(directory, keep=keep)
        existing = checkpointer.latest_step()
        if existing is not None:
            checkpointer.close()
            raise CheckpointError(
                f"{directory} already holds checkpoints (latest: step {existing}); resume from "
                "them (--resume) or choose another output directory"
            )
        return fresh, checkpointer
    checkpointer = open_for_resume(directory, keep=keep)
    try:
        state = with_config(restore_intact(checkpointer, fresh, train_config, data), train_config)
        if int(state.step) > train_config.steps:
            raise ValueError(
                f"the checkpoint is at step {int(state.step)}, past the requested steps "
                f"({train_config.steps}); ask for more steps to continue"
            )
    except BaseException:
        checkpointer.close()
        raise
    return state, checkpointer


def fresh_state(
    model_config: DeepSeekV3Config, train_config: TrainConfig, backend: Backend, mesh: Mesh | None
) -> TrainState:
    """The state before step 0, or (resuming on a mesh) its abstract form, sharded: what a
    restore reads each process's shards into."""

    def make_model():
        return DeepSeekV3(model_config, backend=backend, key=jax.random.key(train_config.seed))

    if mesh is None:
        return init_state(make_model(), train_config)
    if train_config.resume:
        return abstract_sharded_state(make_model, train_config, mesh)
    return init_sharded_state(make_model, train_config, mesh)
