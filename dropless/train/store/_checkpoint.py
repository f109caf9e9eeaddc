"""Checkpoints with orbax-checkpoint: every array of a pytree (model, optimiser state, step), plus
a small JSON of metadata (configs, step), under `<directory>/<step>/`.

Only arrays are written, and only those holding data: orbax refuses zero-size ones (a model
without MoE layers counts its expert load in a 0 x experts array), which `like` supplies on
restore. Restoring takes a freshly built pytree of the same structure (`like`) and fills its
arrays, so the static parts (functions, strategies, configs) always come from code.
The metadata also holds a SHA-256 of every array (`dropless.train.store._digest`), checked on
restore: a corrupt, empty or half-written checkpoint is a `CorruptCheckpoint` error.
"""

import contextlib
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jaxtyping import PyTree

from dropless._files import disk_error, is_disk_error
from dropless.train.store._digest import DIGEST_KEY, digest, mismatches, saved_dtypes


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, empty, corrupt, or does not fit the model."""


class CorruptCheckpoint(CheckpointError):
    """One checkpoint is empty, incomplete, unreadable, or differs from its digest."""


def _brief(err: Exception) -> str:
    """The first line of an error, short: orbax and TensorStore append whole specs."""
    first = (str(err).strip().splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(err).__name__}: {first}"


class Checkpointer:
    """Saves and restores training states in `directory`, keeping the last `keep` of them.

    Saving is asynchronous: `save` returns once the arrays are copied off the device, and the
    files are written in the background; `wait()` (and `close()`) block until they are.
    """

    def __init__(self, directory: str, *, keep: int = 3):
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint path {self.directory} exists and is not a directory")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def steps(self) -> list[int]:
        """Steps that have a checkpoint, oldest first."""
        return sorted(self._manager.all_steps())

    def reload(self) -> None:
        """Reads the directory again: what another process saved or removed since."""
        self._manager.reload()

    def latest_step(self) -> int | None:
        """The newest checkpointed step, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state: PyTree, meta: dict) -> None:
        """Writes the arrays of `state` and the JSON-serialisable `meta` as checkpoint `step`.
        A full or read-only disk, here or in the background write, is a CheckpointError of
        one line naming the directory and the space a checkpoint needs."""
        arrays = eqx.filter(state, _holds_data)
        self._bytes = sum(x.nbytes for x in jax.tree.leaves(arrays))
        meta = {**meta, DIGEST_KEY: digest(arrays)}
        with self._disk_errors():
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                ),
            )

    @contextlib.contextmanager
    def _disk_errors(self):
        try:
            yield
        except Exception as err:
            if not is_disk_error(err):
                raise
            needed = getattr(self, "_bytes", None)
            raise CheckpointError(
                f"cannot save a checkpoint: {disk_error(err, self.directory, needed)}"
            ) from None

    def read_meta(self, step: int | None = None) -> dict:
        """The metadata saved with checkpoint `step` (default: the latest)."""
        meta = self._read_meta(self._resolve(step))
        meta.pop(DIGEST_KEY, None)
        return meta

    def _read_meta(self, step: int) -> dict:
        path = self._path(step)
        if not os.listdir(path):
            raise CorruptCheckpoint(f"checkpoint {path} is empty")
        if not all(os.path.isdir(os.path.join(path, item)) for item in ("state", "meta")):
            raise CorruptCheckpoint(f"checkpoint {path} is incomplete (its save was cut short)")
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception as err:  # orbax raises many types for unreadable files
            raise CorruptCheckpoint(
                f"checkpoint {path} is corrupt or incomplete: cannot read its metadata "
                f"({_brief(err)})"
            ) from None
        return dict(restored.meta)

    def restore(self, like: PyTree, step: int | None = None) -> tuple[PyTree, dict]:
        """(state, meta) of checkpoint `step` (default: the latest).

        `like` is a pytree of the same structure (shapes, dtypes) as the saved state, e.g. a
        freshly initialised one, or an abstract one (`eqx.filter_eval_shape`: nothing is
        allocated before the read); its arrays are replaced by the saved ones.
        """
        step = self._resolve(step)
        meta = self._read_meta(step)
        expected = meta.pop(DIGEST_KEY, None)
        arrays, static = eqx.partition(_empty_as_arrays(like), _holds_data)
        # read in the dtypes they were saved in (checked against the digest), then cast
        dtypes = saved_dtypes(expected) if expected else {}

        def target(path, x):
            spec = ocp.utils.to_shape_dtype_struct(x)
            dtype = dtypes.get(jax.tree_util.keystr(path), spec.dtype)
            return jax.ShapeDtypeStruct(spec.shape, jnp.dtype(dtype), sharding=spec.sharding)

        abstract = jax.tree_util.tree_map_with_path(target, arrays)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
        except Exception as err:  # orbax raises many types for unreadable files
            raise CorruptCheckpoint(
                f"cannot restore checkpoint {self._path(step)}: it is corrupt, incomplete, or "
                f"was written for a different model ({_brief(err)})"
            ) from None
        if expected is not None:
            bad = mismatches(restored.state, expected)
            if bad:
                raise CorruptCheckpoint(
                    f"checkpoint {self._path(step)} is corrupt: {len(bad)} array(s) differ from "
                    f"the digest saved with them ({', '.join(bad[:3])}{', ...' if bad[3:] else ''})"
                )
        # Orbax places what it reads on `like`'s devices, committed. Where `like` was not (a
        # fresh single-device state), commitment would make jit see new arguments and compile
        # the step again in this process; through the host, the array is uncommitted too.
        placed = jax.tree.map(
            lambda new, old: (
                new.astype(old.dtype)
                if _committed(old)
                else jnp.asarray(jax.device_get(new), old.dtype)
            ),
            restored.state,
            arrays,
        )
        return eqx.combine(placed, static), meta

    def set_aside(self, after: int) -> list[str]:
        """Moves the checkpoints of the steps after `after` out of the directory, into
        `<directory>-set-aside/`, so that a run resumed at `after` saves those steps afresh;
        returns where they went. Nothing is deleted."""
        self._manager.reload()
        moved = []
        for step in self.steps():
            if step > after:
                target = os.path.join(f"{self.directory}-set-aside", str(step))
                suffix = 1
                while os.path.exists(target):
                    target = os.path.join(f"{self.directory}-set-aside", f"{step}.{suffix}")
                    suffix += 1
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.rename(self._path(step), target)
                moved.append(target)
        self._manager.reload()
        return moved

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        with self._disk_errors():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases the manager."""
        with self._disk_errors():
            self._manager.close()

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _resolve(self, step: int | None) -> int:
        self._manager.reload()
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; available: {steps}"
            )
        return step


def _holds_data(x) -> bool:
    return (eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)) and x.size > 0


def _empty_as_arrays(tree: PyTree) -> PyTree:
    """`tree` with its zero-size abstract leaves made arrays: nothing is saved or read for them."""

    def empty(x):
        if isinstance(x, jax.ShapeDtypeStruct) and x.size == 0:
            return jnp.zeros(x.shape, x.dtype)
        return x

    return jax.tree.map(empty, tree)


def _committed(x) -> bool:
    # an abstract leaf has no placement to keep: the read array stays where orbax put it
    return isinstance(x, jax.ShapeDtypeStruct) or x.committed


def open_for_resume(directory: str, *, keep: int = 3) -> Checkpointer:
    """A Checkpointer on an existing directory holding at least one checkpoint, or a clear
    CheckpointError (missing directory, not a directory, no checkpoints)."""
    if not os.path.exists(directory):
        raise CheckpointError(
            f"cannot resume: checkpoint directory {os.path.abspath(directory)} does not exist"
        )
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot resume: {os.path.abspath(directory)} is not a directory")
    checkpointer = Checkpointer(directory, keep=keep)
    if checkpointer.latest_step() is None:
        raise CheckpointError(
            f"cannot resume: no checkpoint found in {checkpointer.directory} "
            "(a checkpoint is a numbered sub-directory written by a previous run)"
        )
    return checkpointer
