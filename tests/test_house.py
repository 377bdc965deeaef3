"""The house rules of docs/style.md, checked: lint-clean, each layout path spelled once, no unit too long to read."""

import ast
import functools
import pathlib
import subprocess
import sys

import pytest
import yaml

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DPATH = REPO_ROOT / "workflow" / "saeflow"
RULES_DPATH = REPO_ROOT / "workflow" / "rules"
LAYOUT_FPATH = PACKAGE_DPATH / "store" / "layout.py"
SCHEMA_FPATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
MAX_UNIT_LINES = 120
# Names of the shard and run layouts (saeflow/store/layout.py). "metadata.json" is also the gzip-pickle format's own
# file (activation-shard-pickle-format-1.0), which its module names.
LAYOUT_NAMES = {
    "shards.json": (),
    "checksums.json": (),
    "progress.json": (),
    "provenance.json": (),
    "labels.bin": (),
    "tokens.bin": (),
    "classes.bin": (),
    "metadata.json": ("interop/pickle_shards.py",),
    "checkpoint": (),
    "links": (),
    "sae.pt": (),
    "resume.pt": (),
    "metrics.jsonl": (),
    "metrics.json": (),
    "patch_acts.npz": (),
    "latents.npz": (),
    "train-shards": (),
    "val-shards": (),
    "train-dataset": (),
    "val-dataset": (),
    "index.html": (),
    "app.js": (),
    "style.css": (),
    "data.js": (),
    "neuronpedia-batch.json": (),
    "summary.csv": (),
    "pareto.png": (),
}


def package_modules() -> list[pathlib.Path]:
    return sorted(PACKAGE_DPATH.rglob("*.py"))


@functools.cache  # parsed once for the 21 layout names (the package is not edited while the tests run)
def string_constants(fpath: pathlib.Path) -> frozenset[str]:
    """Every string literal in a module, including the literal parts of f-strings."""
    return frozenset(node.value for node in ast.walk(ast.parse(fpath.read_text())) if isinstance(node, ast.Constant)
                     and isinstance(node.value, str))  # fmt: skip


def test_ruff_finds_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "workflow", "tests", "benchmarks"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(LAYOUT_NAMES))
def test_layout_names_are_spelled_only_in_the_layout_module(name):
    spelled = []
    for fpath in package_modules():
        rel = str(fpath.relative_to(PACKAGE_DPATH))
        if fpath != LAYOUT_FPATH and rel not in LAYOUT_NAMES[name]:
            if any(s == name or s.endswith("/" + name) or s.startswith(name + "/") for s in string_constants(fpath)):
                spelled.append(rel)
    for fpath in sorted(RULES_DPATH.glob("*.smk")):
        text = fpath.read_text()
        if f'"{name}"' in text or f"/{name}" in text or f"{name}/" in text:
            spelled.append(fpath.name)
    assert name in string_constants(LAYOUT_FPATH)
    assert not spelled, f"{name!r} is spelled outside saeflow/store/layout.py in {spelled}"


def test_rules_take_every_layout_path_from_the_layout_patterns():
    for fpath in sorted(RULES_DPATH.glob("*.smk")):
        text = fpath.read_text()
        assert "{RUNS_ROOT}" not in text and "{SHARDS_ROOT}" not in text, f"{fpath.name} spells a path by hand"


def test_no_class_or_function_is_longer_than_a_screenful():
    too_long = []
    for fpath in package_modules():
        for node in ast.walk(ast.parse(fpath.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                n_lines = node.end_lineno - node.lineno + 1
                if n_lines > MAX_UNIT_LINES:
                    too_long.append(f"{fpath.relative_to(PACKAGE_DPATH)}:{node.lineno} {node.name} ({n_lines} lines)")
    assert not too_long, "split these (docs/style.md): " + "; ".join(too_long)


def test_sweep_planning_imports_no_torch():
    """Snakemake plans at parse time, inside every Slurm job: planning must not pay torch's import."""
    code = "import sys, saeflow.planning; assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m]"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)


def test_every_module_counts_a_module_by_its_functions():
    """tests/module_touch.py (`pytest --every-module`, the fast tier's check): a module with a function, a method
    or a lambda counts only once one of them runs; a module or class body alone is no function."""
    from module_touch import _has_function

    def has(source: str) -> bool:
        return _has_function(compile(source, "m.py", "exec"))

    assert has("def f():\n    pass\n") and has("class A:\n    def f(self):\n        pass\n") and has("f = lambda: 1\n")
    assert not has("X = 1\n") and not has("class A:\n    X = 1\n") and not has('"""docs"""\n__version__ = "1"\n')


def schema_enums() -> set[frozenset]:
    """Every enumeration of two or more strings in the config schema."""
    found, todo = set(), [yaml.safe_load(SCHEMA_FPATH.read_text())]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            values = node.get("enum")
            if isinstance(values, list) and len(values) >= 2 and all(isinstance(v, str) for v in values):
                found.add(frozenset(values))
            todo += node.values()
        elif isinstance(node, list):
            todo += node
    return found


def test_no_module_copies_an_enum_the_schema_holds():
    """The schema is the one list of a key's values: code (CLI `choices` included) reads it (config.enum)."""
    enums, copies = schema_enums(), []
    for fpath in package_modules():
        for node in ast.walk(ast.parse(fpath.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
            ):
                if frozenset(e.value for e in node.elts) in enums:
                    copies.append(f"{fpath.relative_to(PACKAGE_DPATH)}:{node.lineno}")
    assert enums and not copies, "read these from the schema (config.enum): " + "; ".join(copies)
