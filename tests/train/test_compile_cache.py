"""The persistent compilation cache switch (set and restored here; nothing compiles with it on:
the test suite uses no persistent cache, tests/conftest.py says why)."""

import jax
import pytest

from dropless.train import enable_compile_cache


@pytest.fixture
def jax_cache_settings():
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in before.items():
        jax.config.update(name, value)


def test_the_cache_goes_to_the_dropless_folder_and_keeps_any_chosen_one(
    jax_cache_settings, tmp_path, monkeypatch
):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    assert enable_compile_cache() == str(tmp_path / "dropless" / "jax")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "dropless" / "jax")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0  # small programs too
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert enable_compile_cache() == str(tmp_path / "mine")  # one already set is kept
    assert enable_compile_cache(str(tmp_path / "asked")) == str(tmp_path / "asked")
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert enable_compile_cache() == str(tmp_path / "env")
