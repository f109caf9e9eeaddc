"""Every Python code block of the tutorials runs: blocks of one page share a namespace and run
in order, as a reader would run them."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIALS = [
    "backends.md",
    "concepts.md",
    "deepseek-v3.md",
    "getting-started.md",
    "qwen3-moe.md",
]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    return BLOCK.findall((DOCS / page).read_text())


@pytest.mark.parametrize("page", TUTORIALS)
@pytest.mark.slow
def test_tutorial_code_blocks_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no python code blocks"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page}"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{page}[block {i}]", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{page}, python block {i} failed:\n{block}") from err


def test_mkdocs_nav_pages_exist():
    nav = re.findall(r":\s*([\w\-/]+\.md)\s*$", (DOCS.parent / "mkdocs.yml").read_text(), re.M)
    assert nav
    assert [p for p in nav if not (DOCS / p).exists()] == []


@pytest.mark.slow
def test_mkdocs_build_is_strict_clean(tmp_path):
    """The documentation site builds with `mkdocs build --strict` (warnings are errors)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "index.html").stat().st_size > 1000
