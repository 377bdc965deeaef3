"""The house rules of docs/style.md and docs/architecture.md, checked: lint-clean, each layout path spelled once, no
unit or module too long to read, imports that point down the stages and never in a circle, each schema enum in one
place, and each config key reaching its bytes through few files."""

import ast
import functools
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from hang import HANG_SEC

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DPATH = REPO_ROOT / "workflow" / "saeflow"
RULES_DPATH = REPO_ROOT / "workflow" / "rules"
LAYOUT_FPATH = PACKAGE_DPATH / "store" / "layout.py"
SCHEMA_FPATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
MAX_UNIT_LINES = 120
MAX_MODULE_LINES = 500
MAX_KEY_FILES = 5
# Keys whose honest route is longer, and why (docs/style.md, docs/architecture.md): `k` is typed in training/specs
# and hashed at a fixed value by a run that does not read it (training/sweeps.UNREAD); `layers` is resolved against the
# checkpoint's depth (extraction/models.resolve_layers: negative indices) before the spec hashes it; `shards_root` is
# where every shard directory is published, so it travels as a parameter from the commands through extraction
# (extract, seal, specs.ShardsSpec.metadata) to the two writers that publish into it (store/shards writer and parts).
KEY_FILE_LIMITS = {"k": 6, "layers": 6, "shards_root": 9}
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
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=HANG_SEC)


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
    """The schema is the one list of a key's values: code (CLI `choices` included) reads it (config.enum), and a
    table keyed by its values (a dict counts) is checked against it (config.by_enum)."""
    enums, copies = schema_enums(), []
    for fpath in package_modules():
        tree = ast.parse(fpath.read_text())
        checked = {id(call.args[0]) for call in ast.walk(tree) if isinstance(call, ast.Call) and call.args
                   and getattr(call.func, "attr", getattr(call.func, "id", None)) == "by_enum"}  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in checked:  # a table keyed by the enum, checked against it at import (config.by_enum)
                continue
            elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)  # a dict's keys count
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts
            ):
                if frozenset(e.value for e in elts) in enums:
                    copies.append(f"{fpath.relative_to(PACKAGE_DPATH)}:{node.lineno}")
    assert enums and not copies, "read these from the schema (config.enum): " + "; ".join(copies)


def test_no_module_is_longer_than_500_lines():
    too_long = [f"{fpath.relative_to(PACKAGE_DPATH)} ({n} lines)" for fpath in package_modules()
                if (n := len(fpath.read_text().splitlines())) > MAX_MODULE_LINES]  # fmt: skip
    assert not too_long, "split these along their seams (docs/style.md): " + "; ".join(too_long)


# ---------------------------------------------------------------------------------------------------------------
# Imports: the static graph of the package (imports inside functions included)
# ---------------------------------------------------------------------------------------------------------------

# The stages, lowest first (docs/architecture.md): a module imports its own stage or lower ones only. The first
# floor's modules may import one another; elsewhere a floor's packages (analysis and interop) do not.
FLOORS = (
    ("saeflow", "saeflow.errors", "saeflow.config", "saeflow.schema_errors", "saeflow.numerics", "saeflow.devices",
     "saeflow.preempt"),
    ("saeflow.store",),
    ("saeflow.extraction",),
    ("saeflow.training",),
    ("saeflow.analysis", "saeflow.interop"),
    ("saeflow.planning",),
    ("saeflow.migration",),
    ("saeflow.commands",),
    ("saeflow.cli",),
    ("saeflow.__main__",),
)


def module_name(fpath: pathlib.Path) -> str:
    parts = fpath.relative_to(PACKAGE_DPATH.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's __init__ when it imports the package itself)."""
    modules = {module_name(fpath): fpath for fpath in package_modules()}
    graph = {}
    for name, fpath in modules.items():
        found = set()
        for node in ast.walk(ast.parse(fpath.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "saeflow":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name in modules}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def floor_of(module: str) -> tuple[int, str]:
    """(floor, the unit on it: a stage package or a module) of a package module."""
    for i, names in enumerate(FLOORS):
        for unit in sorted(names, key=len, reverse=True):
            if module == unit or (unit != "saeflow" and module.startswith(unit + ".")):
                return i, unit
    return 0, "saeflow"


def test_no_import_cycles():
    graph, cycles = import_graph(), []
    for start in sorted(graph):
        todo, seen = [(start, [start])], set()
        while todo:
            module, path = todo.pop()
            for dep in sorted(graph[module]):
                if dep == start:
                    cycles.append(" -> ".join([*path, dep]))
                elif dep not in seen and dep > start:  # each cycle is found from its smallest module only
                    seen.add(dep)
                    todo.append((dep, [*path, dep]))
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_imports_point_down_the_stages():
    upward = []
    for module, deps in import_graph().items():
        (floor, unit) = floor_of(module)
        for dep in deps:
            dep_floor, dep_unit = floor_of(dep)
            if dep_floor > floor or (dep_floor == floor and dep_unit != unit and floor > 0):
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports that point up or across the stages: " + "; ".join(sorted(upward))


# ---------------------------------------------------------------------------------------------------------------
# Files per config key: how many files a reader opens to follow a key from config/config.yaml to the bytes it changes
# ---------------------------------------------------------------------------------------------------------------

# key -> (the modules that type it, the commands whose jobs write its bytes). The walk (docs/architecture.md,
# "How a key reaches its bytes"): start at the typed field's module; add every module that names the key and imports,
# or is imported by, a module already on the route, among the modules those commands and planning import (the
# workflow plans first); count them, the schema (which declares the key and its default) and the rules that name it.
KEY_ROUTES = {
    "k": (("saeflow.training.specs",), ("saeflow.commands.train",)),
    "layers": (("saeflow.extraction.specs",), ("saeflow.commands.extract",)),
    "shards_root": (("saeflow.planning",), ("saeflow.commands.extract", "saeflow.commands.train")),
    "hook": (("saeflow.extraction.specs",), ("saeflow.commands.extract",)),
}


def names_key(fpath: pathlib.Path, key: str) -> bool:
    """The module names the key: a field `key: ...` of a class, an attribute `.key`, a keyword `key=`, a function's
    parameter `key`, or the string "key" (or its flag "--key-name")."""
    spelled = {key, "--" + key.replace("_", "-")}
    for node in ast.walk(ast.parse(fpath.read_text())):
        if isinstance(node, ast.ClassDef):
            fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            if key in fields:
                return True
        elif isinstance(node, ast.Attribute) and node.attr == key or isinstance(node, ast.keyword) and node.arg == key:
            return True
        elif isinstance(node, ast.arg) and node.arg == key:
            return True
        elif isinstance(node, ast.Constant) and node.value in spelled:
            return True
    return False


def imported_through_faces(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph where importing a package's face (an __init__ that hands names on) imports what it hands on."""
    faces = {m for m in graph if (PACKAGE_DPATH.parent / m.replace(".", "/") / "__init__.py").is_file()}
    seen = {}
    for module, deps in graph.items():
        todo, found = list(deps), set()
        while todo:
            dep = todo.pop()
            if dep not in found:
                found.add(dep)
                todo += graph[dep] if dep in faces else []
        seen[module] = found
    return seen


def key_route(key: str, holders: tuple[str, ...], commands: tuple[str, ...]) -> list[str]:
    graph = imported_through_faces(import_graph())
    scope, todo = set(), [*commands, "saeflow.planning"]
    while todo:
        module = todo.pop()
        if module not in scope:
            scope.add(module)
            todo += graph[module]
    fpaths = {module_name(fpath): fpath for fpath in package_modules()}
    route, grew = set(holders), True
    while grew:
        near = {m for m in scope - route if any(m in graph[r] or r in graph[m] for r in route)}
        grew = bool(added := {m for m in near if names_key(fpaths[m], key)})
        route |= added
    rules = [f.name for f in sorted(RULES_DPATH.glob("*.smk"))
             if re.search(rf"(?<![\w-]){key}(?![\w-])", re.sub(r"#.*", "", f.read_text()))]  # fmt: skip
    schema = [SCHEMA_FPATH.name] if re.search(rf"(?m)^\s*{key}:", SCHEMA_FPATH.read_text()) else []
    return schema + sorted(route) + rules


@pytest.mark.parametrize("key", sorted(KEY_ROUTES))
def test_a_config_key_reaches_its_bytes_through_at_most_5_files(key):
    """Following `k`, `layers` or `shards_root` from config/config.yaml to the bytes it changes opens few files (a
    function's parameter named after the key counts: issue 33 found `shards_root` in 9 files, not 5)."""
    route = key_route(key, *KEY_ROUTES[key])
    limit = KEY_FILE_LIMITS.get(key, MAX_KEY_FILES)
    assert KEY_ROUTES[key][0][0] in route and len(route) <= limit, f"{key}: {len(route)} files: {route}"
    assert len(route) == limit or key not in KEY_FILE_LIMITS, f"{key}: {len(route)} files now; lower its limit"


def test_a_parameter_named_after_the_key_puts_its_module_on_the_route():
    assert "saeflow.store.shards.writer" in key_route("shards_root", *KEY_ROUTES["shards_root"])


def test_a_table_keyed_by_an_enum_is_checked_against_the_schema():
    from saeflow import config
    from saeflow.errors import SaeflowError

    assert config.by_enum({"wandb": 1, "tensorboard": 2}, "train", "tracking") == {"wandb": 1, "tensorboard": 2}
    with pytest.raises(SaeflowError, match=r"missing \['tensorboard'\], not in the schema \['mlflow'\]"):
        config.by_enum({"wandb": 1, "mlflow": 2}, "train", "tracking")


# ---------------------------------------------------------------------------------------------------------------
# One seam per architecture (DESIGN principle 13): only training/archs/ knows an architecture by its name
# ---------------------------------------------------------------------------------------------------------------

ARCHS_DPATH = PACKAGE_DPATH / "training" / "archs"


def arch_name_tests(source: str, names: frozenset[str]) -> list[int]:
    """Lines where a value is tested against a string literal naming an architecture: compared with it (==, !=,
    is, in, not in; also inside a tuple, list or set), matched against it (match/case), or looked up by it (a dict
    literal keyed by it)."""

    def is_name(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in node.elts)

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(is_name(n) for n in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and is_name(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(key is not None and is_name(key) for key in node.keys):
            lines.append(node.lineno)
    return lines


def test_the_arch_name_test_finds_each_way_of_testing_a_name():
    names = frozenset({"relu", "topk"})
    assert arch_name_tests("if cfg.arch == 'relu':\n    pass\n", names) == [1]
    assert arch_name_tests("x = a in ('topk', 'other')\n", names) == [1]
    assert arch_name_tests("match arch:\n    case 'topk':\n        pass\n", names) == [2]
    assert arch_name_tests("NAMES = {'relu': 'standard'}\n", names) == [1]
    assert arch_name_tests("x = cfg.get('activation', 'topk')\nif arch.name == other:\n    pass\n", names) == []


def test_no_code_outside_the_registry_tests_an_architecture_name():
    """Every trainer, stage and format asks training/archs (`archs.get(name)`: the activation, losses, decoder policy,
    threshold statistics, parallel modes, SAELens and sparsify names), so adding an architecture is one module."""
    from saeflow import config

    names = frozenset(config.enum("sae_spec", "arch"))
    found = [f"{fpath.relative_to(PACKAGE_DPATH)}:{line}" for fpath in package_modules()
             if ARCHS_DPATH not in fpath.parents for line in arch_name_tests(fpath.read_text(), names)]  # fmt: skip
    assert not found, "ask the architecture (saeflow.training.archs) instead: " + "; ".join(found)
