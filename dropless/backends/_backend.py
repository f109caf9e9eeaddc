"""`Backend`: one strategy per MoE stage, any of them left out; and the hardware checks that
decide which bundles load."""

import equinox as eqx
import jax

from dropless._dispatch import AbstractDispatcher, AbstractExpertParallelDispatcher
from dropless._experts import AbstractGroupedMatmul
from dropless._routing import AbstractTopK


class Backend(eqx.Module):
    """One strategy per stage; a stage left as None keeps whatever the model has there.

    Backend(gmm=RaggedDot())    # swaps only the grouped matmul (`with_backend`)
    """

    dispatcher: AbstractDispatcher | None = None
    gmm: AbstractGroupedMatmul | None = None
    topk: AbstractTopK | None = None

    def __check_init__(self):
        for name, value, kind, wanted in (
            ("dispatcher", self.dispatcher, AbstractDispatcher, "an AbstractDispatcher"),
            ("gmm", self.gmm, AbstractGroupedMatmul, "an AbstractGroupedMatmul"),
            ("topk", self.topk, AbstractTopK, "an AbstractTopK"),
        ):
            if value is not None and not isinstance(value, kind):
                hint = " (a backend's name goes to dropless.train.get_backend)"
                raise TypeError(
                    f"Backend.{name} must be {wanted} or None, got {value!r}"
                    f"{hint if isinstance(value, str) else ''}"
                )

    @property
    def requires_gpu(self) -> bool:
        """Whether any of its strategies runs only on a GPU."""
        parts = (self.dispatcher, self.gmm, self.topk)
        return any(type(p).requires_gpu for p in parts if p is not None)

    @property
    def expert_parallel(self) -> bool:
        """Whether its dispatcher exchanges tokens over an expert axis of a device mesh (so it
        runs only inside a sharded step that has one)."""
        return isinstance(self.dispatcher, AbstractExpertParallelDispatcher)


class BackendUnavailableError(ImportError):
    """A backend was asked for by name but its dependencies or hardware are missing."""


def has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def is_hopper() -> bool:
    """Whether the first device is a Hopper GPU (compute capability 9.x): our Mosaic kernels'
    warpgroup matmuls need one."""
    device = jax.devices()[0]
    capability = str(getattr(device, "compute_capability", ""))
    return device.platform == "gpu" and capability.startswith("9.")
