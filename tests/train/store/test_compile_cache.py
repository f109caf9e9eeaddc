"""The persistent compilation cache switch (set and restored here; nothing compiles with it on:
the test suite uses no persistent cache, tests/conftest.py says why)."""

import jax
import pytest
from jax._src.compilation_cache import compress_executable

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


def test_an_empty_or_cut_off_entry_is_removed_so_jax_writes_it_again(jax_cache_settings, tmp_path):
    good = compress_executable(b"a compiled program" * 100)
    (tmp_path / "good-cache").write_bytes(good)
    (tmp_path / "good-atime").write_bytes(b"\0" * 8)
    (tmp_path / "empty-cache").write_bytes(b"")  # a kill before the first byte
    (tmp_path / "empty-atime").write_bytes(b"\0" * 8)
    (tmp_path / "cut-cache").write_bytes(good[: len(good) // 2])  # a kill part-way
    enable_compile_cache(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "good-atime",
        "good-cache",
    ]
