"""`jax.lax.ragged_dot` as a grouped-matmul strategy: a reference."""

from typing import ClassVar

import jax.numpy as jnp
from jax import lax

from dropless._experts import AbstractGroupedMatmul


class RaggedDot(AbstractGroupedMatmul):
    """`jax.lax.ragged_dot`: exact; XLA lowers it to a dense contraction over all experts."""

    requires_gpu: ClassVar[bool] = False

    def _impl(self, lhs, rhs, group_sizes):
        return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))
