"""The library's import layers, each importing only from its own layer or the ones below, with
imports of dropless modules at the top of a module (imports inside functions are for optional
dependencies only: TE, tokamax, torch, transformers):

    core < nn < models, data < sharding < train.config, train.backend_names < train.step
         < train.plan < train.store < train.loop < train (the package, which re-exports the
         wings) < cli

`sharding` (the mesh, the spec table, placement, `ShardedMoE`) is a layer of its own; `train/` is
in wings (step, plan, store, loop) that import one way, in that order, above its config edge
(`TrainConfig`, and the backends by name: the core takes `Backend` values only). A `_name`
module (the implementation behind its package's re-exports) is in its package's layer: names are
read without their leading underscore.

Read from the source with `ast`, so a violation is found without importing anything."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dropless"
LAYERS = {"core": 0, "nn": 1, "models": 2, "data": 2, "cli": 10}
# The rooms above `data`, by the first one or two parts of the module's name under `dropless`.
ROOMS = {
    "sharding": 3,
    "train.config": 4,
    "train.backend_names": 4,
    "train.step": 5,
    "train.plan": 6,
    "train.store": 7,
    "train.loop": 8,
    "train": 9,
}

# Known exceptions, (module, imported module): none.
ALLOWED: set[tuple[str, str]] = set()


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def layer(module: str) -> int:
    """The layer of a dropless module: its room (`train.step`, `sharding`, ...) or else its
    first part under `dropless` names it; the rest (routing, dispatch, experts, moe, backends,
    ...) are the core."""
    parts = [p if p.startswith("__") else p.removeprefix("_") for p in module.split(".")]
    first = parts[1] if len(parts) > 1 else ""
    if first in ("cli", "__main__"):
        return LAYERS["cli"]
    two = ".".join(parts[1:3])
    if two in ROOMS:
        return ROOMS[two]
    if first in ROOMS:
        return ROOMS[first]
    return LAYERS.get(first, LAYERS["core"])


def resolve(node: ast.ImportFrom, importer: str, package: bool) -> list[str]:
    """The dropless modules an import statement loads: `from a import b` loads `a.b` when that
    is a module, else `a`."""
    if node.level:  # relative: from the importer's package
        base = importer.split(".")
        base = base[: len(base) - node.level + (1 if package else 0)]
        module = ".".join([*base, node.module] if node.module else base)
    else:
        module = node.module or ""
    if module.split(".")[0] != "dropless":
        return []
    out = []
    for alias in node.names:
        sub = pathlib.Path(ROOT, *module.split("."), alias.name)
        is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
        out.append(f"{module}.{alias.name}" if is_module else module)
    return sorted(set(out))


def imports(path: pathlib.Path, source: str | None = None) -> list[tuple[str, bool, int]]:
    """(dropless module, whether the import is inside a function, line) for every import of
    the module at `path` (whose text is `source`, if given)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    importer = module_name(path)
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dropless":
                    found.append((alias.name, in_function, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            for module in resolve(node, importer, is_package(path)):
                found.append((module, in_function, node.lineno))
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def violations() -> list[tuple[str, str, str]]:
    """(importer, imported, why) for every import that breaks the layering."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for module, in_function, line in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if layer(module) > layer(importer):
                out.append((importer, module, f"{where}: upward import"))
            backends_moe = importer.startswith("dropless.backends") and module in (
                "dropless._moe",
                "dropless.sharding",
            )
            if backends_moe:
                out.append((importer, module, f"{where}: a backend imports the layer above it"))
            if in_function:
                out.append((importer, module, f"{where}: import inside a function"))
    return out


def test_the_layers_are_known():
    assert layer("dropless") == layer("dropless._moe") == layer("dropless.backends._sort") == 0
    assert layer("dropless._swiglu") == 0
    assert layer("dropless.nn._mla") == 1
    assert layer("dropless.models.deepseek_v3._block") == layer("dropless.data._datasets") == 2
    upward = [
        "dropless.sharding._mesh",
        "dropless.train._config",
        "dropless.train.step._sharded",
        "dropless.train.plan._plan",
        "dropless.train.store._checkpoint",
        "dropless.train.loop._loop",
        "dropless.train",
        "dropless.cli",
    ]
    layers = [layer(m) for m in upward]
    assert layers == sorted(set(layers))
    assert layer("dropless.sharding") == layer("dropless.sharding._expert_parallel")
    assert layer("dropless.train.step._step") == layer("dropless.train.step._sharded")
    assert layer("dropless.train._backend_names") == layer("dropless.train._config")
    assert layer("dropless.cli") == layer("dropless.__main__") == layer("dropless.cli._run")
    assert layer("dropless._allocator") == layer("dropless.backends.mosaic._launch") == 0


def test_imports_point_down_and_sit_at_the_top():
    found = violations()
    wrong = [why for importer, module, why in found if (importer, module) not in ALLOWED]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


@pytest.mark.parametrize("entry", sorted(ALLOWED))
def test_allowed_offenders_still_exist(entry):
    """An entry of ALLOWED whose import is gone is removed from the list."""
    assert entry in {(importer, module) for importer, module, _ in violations()}


def test_the_checker_finds_what_it_looks_for():
    source = "from dropless.train.loop import _loop\n\n\ndef f():\n    import dropless._moe\n"
    importer = PACKAGE / "backends" / "_chunked.py"
    found = imports(importer, source)
    assert ("dropless.train.loop._loop", False, 1) in found
    assert ("dropless._moe", True, 5) in found
    assert layer("dropless.train.loop._loop") > layer(module_name(importer))
