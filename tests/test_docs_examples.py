"""The code in docs/examples runs and is right: the custom backend of docs/backends.md equals
the dense oracle, output and gradients."""

import importlib.util
import pathlib

import jax
import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "examples"
FP32 = dict(rtol=1e-4, atol=1e-5)  # MoE vs oracle, as in tests/test_moe.py


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_backend_equals_oracle():
    example = load("custom_backend")
    (y, grads), (y_ref, grads_ref) = example.compare_with_oracle()
    np.testing.assert_allclose(y, y_ref, **FP32)
    assert len(grads) == len(grads_ref) > 0
    for a, b in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(a, b, **FP32)
    assert type(example.BACKEND.gmm).__name__ == "MaskedGroupedMatmul"
    assert jax.tree.leaves(example.BACKEND) == []  # parameter-free strategies: no arrays


def test_conventions_lists_every_glossary_name():
    from dropless._types import GLOSSARY

    text = (EXAMPLES.parent / "conventions.md").read_text()
    missing = [name for name in GLOSSARY if f"| `{name}` |" not in text]
    assert not missing, f"docs/conventions.md lacks glossary names {missing}"
