"""Digests of a checkpoint's arrays: a SHA-256 of each array's bytes, keyed by its path in the
pytree, saved in the checkpoint's metadata (which orbax commits with the arrays) and checked
when the checkpoint is restored. A flipped bit in any array file is then an error that names
the array, instead of a run that trains on from wrong numbers."""

import hashlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import PyTree

# The metadata key that holds the digests.
DIGEST_KEY = "array_sha256"


def _host(x) -> np.ndarray:
    # An array spread over several processes is gathered whole (every process saves and
    # restores together, so each reaches this collective in the same order).
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.ascontiguousarray(np.asarray(jax.device_get(x)))


def digest(arrays: PyTree) -> dict[str, dict]:
    """{path: {"dtype", "shape", "sha256"}} for every array leaf of `arrays`, in tree order."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(arrays):
        host = _host(leaf)
        out[jax.tree_util.keystr(path)] = {
            "dtype": str(host.dtype),
            "shape": list(host.shape),
            "sha256": hashlib.sha256(host.view(np.uint8).reshape(-1)).hexdigest(),
        }
    return out


def mismatches(arrays: PyTree, expected: dict[str, dict]) -> list[str]:
    """Paths of the leaves of `arrays` whose bytes, dtype or shape differ from `expected`
    (`digest`'s result for the saved arrays), plus paths missing on either side."""
    got = digest(arrays)
    return sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))


def saved_dtypes(expected: dict[str, dict]) -> dict[str, str]:
    """path -> the dtype each array was saved in."""
    return {path: entry["dtype"] for path, entry in expected.items()}
