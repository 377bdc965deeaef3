"""Load and validate a saeflow config against the one schema (workflow/schemas/config.schema.yaml).

The schema holds every key and every default; Snakemake's `validate(config, schema)` and this loader apply the
same file, so the workflow and the CLI can never disagree on a default. The command-line options of a section's
settings (`inference`, `visuals`, `train`) are generated from the same schema (`add_section_options`), and the
workflow passes a section to the CLI as the flags that differ from the defaults (`section_flags`).
"""

import argparse
import copy
import dataclasses
import functools
import getpass
import os
import pathlib
import typing

import jsonschema
import yaml

from saeflow.errors import SaeflowError, one_line, read_problem
from saeflow.schema_errors import explain

SCHEMA_FPATH = pathlib.Path(__file__).resolve().parent / "schemas" / "config.schema.yaml"
ROOT_KEYS = ("shards_root", "runs_root", "summary_dir")  # where the workflow writes; `default_roots` may fill them
# The storage spec's roots (storage-and-run-manifest-v1: $SAEV_SCRATCH and $SAEV_NFS are set for every user and
# process): used where no config and no profile gives the root and the variable is set (resolve_roots).
ENV_ROOTS = {"shards_root": ("SAEV_SCRATCH", "saev/shards"), "runs_root": ("SAEV_NFS", "saev/runs")}
# libyaml's parser where PyYAML has it: every CLI and Snakemake process reads the schema (0.06 s in Python, 0.005 in C)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MERGE_TAG = "tag:yaml.org,2002:merge"  # the key `<<` (YAML 1.1 merge)


@functools.cache
def load_schema() -> dict:
    """The parsed schema, read once per process. Read-only: validation deep-copies defaults into configs."""
    return yaml.load(SCHEMA_FPATH.read_text(encoding="utf-8"), Loader=SAFE_LOADER)  # noqa: S506 (a safe loader)


def def_schema(name: str) -> dict:
    """A standalone schema for one `$defs` entry (e.g. one activation spec), its references still resolvable."""
    schema = load_schema()
    return {**schema["$defs"][name], "$defs": schema["$defs"]}


def _extend_with_defaults(validator_cls):
    """A validator that fills in `default` values as it validates (as Snakemake's validate does)."""
    validate_properties = validator_cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_cls, {"properties": set_defaults})


_Validator = _extend_with_defaults(jsonschema.Draft202012Validator)


def validate(config: dict, schema: dict | None = None) -> dict:
    """Validate in place, fill defaults, return the config; the error names the offending key path and what is
    valid there (schema_errors.explain)."""
    schema = schema or load_schema()
    errors = sorted(_Validator(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        lines = []
        for err in errors[:10]:
            where, message = explain(err)
            lines.append(f"  {where}: {message}")
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise SaeflowError("config does not match the schema:\n" + "\n".join(lines) + more)
    return config


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping that writes a key twice (plain YAML keeps the last one, silently).

    Only a mapping's own keys count: a key it also merges (`<<: *base` or `<<: [*a, *b]`) is YAML's ordinary
    override, read as PyYAML reads it (its own key wins). The check runs in `flatten_mapping`, which PyYAML calls on
    every mapping, merged ones included, before it puts their entries in front of the mapping's own."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked_node_ids = set()  # a merged mapping is flattened again each time it is merged: check it once

    def flatten_mapping(self, node):
        if id(node) not in self._checked_node_ids:
            self._checked_node_ids.add(id(node))
            own_keys = self._refuse_repeated_keys(node)
            for key_node, value_node in node.value:
                if key_node.tag == MERGE_TAG and isinstance(value_node, yaml.SequenceNode):
                    self._refuse_conflicting_merges(value_node, own_keys)
        super().flatten_mapping(node)

    def _refuse_repeated_keys(self, node) -> set:
        """The mapping's own keys; a ConstructorError naming both lines when one is written twice."""
        first_line = {}
        for key_node, _ in node.value:
            key = "<<" if key_node.tag == MERGE_TAG else self.construct_object(key_node, deep=True)
            try:
                seen = first_line.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if seen is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first given on line {seen})", key_node.start_mark,
                )  # fmt: skip
            first_line[key] = key_node.start_mark.line + 1
        return set(first_line)

    def _refuse_conflicting_merges(self, sequence_node, own_keys: set) -> None:
        """`<<: [*a, *b]` where a and b both give a key the mapping does not set itself: YAML takes a's value,
        PyYAML (so Snakemake, which reads the same file) mostly b's, so either reading could be wrong."""
        first_given = {}  # key -> its key node in the first mapping that gives it
        for sub_node in sequence_node.value:
            if not isinstance(sub_node, yaml.MappingNode):
                continue  # the base class reports it
            self.flatten_mapping(sub_node)
            for key_node, _ in sub_node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, typing.Hashable) or key in own_keys:
                    continue
                first = first_given.setdefault(key, key_node)
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", sequence_node.start_mark,
                        f"key {key!r} is merged from two mappings (lines {first.start_mark.line + 1} and "
                        f"{key_node.start_mark.line + 1}), which YAML and PyYAML resolve differently: set it in "
                        "the mapping itself", sequence_node.start_mark,
                    )  # fmt: skip


def _yaml_problem(err: yaml.YAMLError) -> str:
    """`line N: what` for a YAML error (the mark of the problem, else of its context), on one line."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    what = " ".join(str(getattr(err, "problem", None) or err).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what


def read_yaml(fpath: str | pathlib.Path) -> dict:
    """A YAML/JSON config file as a mapping, read strictly: a repeated key, a syntax error or a non-mapping is a
    SaeflowError naming the file (and the line), on one line."""
    fpath = pathlib.Path(fpath)
    try:
        config = yaml.load(fpath.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (safe subclass)
    except FileNotFoundError:
        raise SaeflowError(f"config file {fpath} does not exist") from None
    except OSError as err:
        raise SaeflowError(f"config file {fpath}: {read_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise SaeflowError(f"config file {fpath}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        raise SaeflowError(f"config file {fpath}: not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(config, dict):
        raise SaeflowError(f"config file {fpath} must hold a mapping, got {type(config).__name__}")
    return config


def expand_path(value: str, key: str) -> pathlib.Path:
    """A path of the config with $VARS and ~ expanded (the OSC profile's roots use $USER): the one expansion the
    planner and every command apply. An unset variable is an error naming the key."""
    os.environ.setdefault("USER", getpass.getuser())  # unset in some batch and container shells
    expanded = os.path.expanduser(os.path.expandvars(str(value)))
    if "$" in expanded:
        raise SaeflowError(f"{key}: {value!r} names an environment variable that is not set")
    return pathlib.Path(expanded)


def root(config: dict, key: str, given: str | pathlib.Path | None, flag: str) -> pathlib.Path:
    """The root a command uses: the option's value when given, else the config's; either way expanded as the
    planner expands it (`expand_path`), so a command and the workflow agree on every path."""
    return expand_path(given, flag) if given is not None else expand_path(config[key], key)


def resolve_roots(config: dict, files: list[tuple[str, dict]], overrides: dict) -> dict[str, str]:
    """Fill in each root (`ROOT_KEYS`) that no config file and no --config gives from `default_roots` (what a
    profile supplies), else from the storage spec's environment (`ENV_ROOTS`: `$SAEV_SCRATCH/saev/shards`,
    `$SAEV_NFS/saev/runs`, where the variable is set and not empty), in place and before the schema's defaults;
    return where each root comes from.

    A Snakemake profile's `config:` is a --config, which beats every --configfile, so a profile that set the roots
    themselves would silently win over the user's own file: it sets `default_roots` instead. `files` are the
    config files read, in order, as (path, content); `overrides` is the --config mapping."""
    defaults = config.get("default_roots")
    defaults = defaults if isinstance(defaults, dict) else {}  # a malformed one is the schema's to report
    sources = {}
    for key in ROOT_KEYS:
        in_files = [fpath for fpath, content in files if key in content]
        if key in overrides:
            sources[key] = "--config or a profile's `config:`"
        elif in_files:
            sources[key] = f"config file {in_files[-1]}"
        elif key in config:
            sources[key] = "the workflow's config"
        elif key in defaults:
            config[key] = defaults[key]
            sources[key] = "default_roots (the profile's default)"
        elif key in ENV_ROOTS and os.environ.get(ENV_ROOTS[key][0]):
            variable, subdir = ENV_ROOTS[key]
            config[key] = f"${variable}/{subdir}"
            sources[key] = f"${variable} (the storage spec's environment)"
        else:
            sources[key] = "schema default"
    return sources


def describe_roots(config: dict, sources: dict[str, str]) -> list[str]:
    """One line per root: the expanded path and where it comes from (printed by `snakemake -n` and `saeflow plan`)."""
    return [f"{key}: {expand_path(config[key], key)} (from {sources[key]})" for key in ROOT_KEYS]


def check(config: dict, fpaths: list[str]) -> None:
    """Validate a copy of the workflow's config, the error naming its config files and the key on one line: the
    workflow calls this before Snakemake's own `validate`, whose error prints the whole schema."""
    try:
        validate(copy.deepcopy(config))
    except SaeflowError as err:
        raise SaeflowError(f"{_files_named(fpaths)}: {one_line(err)}") from None


def _files_named(fpaths: list) -> str:
    if not fpaths:
        return "the config"
    return f"config file {fpaths[0]}" if len(fpaths) == 1 else f"config files {', '.join(map(str, fpaths))}"


ConfigFiles = str | pathlib.Path | list[str | pathlib.Path]


def load(fpaths: ConfigFiles, overrides: dict | None = None) -> dict:
    """Read YAML/JSON config files (`read_files`), apply top-level overrides and `default_roots`, validate and fill
    defaults."""
    return load_with_root_sources(fpaths, overrides)[0]


def read_files(fpaths: ConfigFiles) -> tuple[dict, list[tuple[str, dict]]]:
    """Config files, each read strictly (`read_yaml`), merged as Snakemake merges the files of `--configfile A B`
    (its own `update_config`: a mapping key by key, recursively; any other value of a later file replaces the
    earlier one): the merged config, and (path, content) of each file, in order. One file is read as it is."""
    fpaths = [fpaths] if isinstance(fpaths, (str, pathlib.Path)) else list(fpaths)
    files = [(str(fpath), read_yaml(fpath)) for fpath in fpaths]
    merged = copy.deepcopy(files[0][1]) if files else {}
    if len(files) > 1:
        from snakemake.utils import update_config  # 0.05 s to import: only when there is something to merge

        for _, content in files[1:]:
            update_config(merged, copy.deepcopy(content))
    return merged, files


def load_with_root_sources(fpaths: ConfigFiles, overrides: dict | None = None) -> tuple[dict, dict[str, str]]:
    """`load`, and where each root comes from (`resolve_roots`)."""
    config, files = read_files(fpaths)
    sources = resolve_roots(config, files, overrides or {})
    config.update(overrides or {})
    try:
        return validate(config), sources
    except SaeflowError as err:
        raise SaeflowError(f"{_files_named([fpath for fpath, _ in files])}: {err}") from None


def pick(section: dict, name: str | None, what: str) -> tuple[str, typing.Any]:
    """One named entry of a config section; the only one when `name` is None."""
    if name is None:
        if len(section) != 1:
            raise SaeflowError(f"the config has {len(section)} {what}s ({', '.join(section)}); choose one by name")
        return next(iter(section.items()))
    if name not in section:
        raise SaeflowError(f"no {what} named {name!r}; the config has: {', '.join(section) or 'none'}")
    return name, section[name]


def schema_default(def_name: str, *path: str):
    """The default of a nested key of a `$defs` entry, e.g. ("model", "revision") of "activation_spec"."""
    node = load_schema()["$defs"][def_name]
    for key in path:
        node = node["properties"][key]
    return copy.deepcopy(node["default"])


def dataset_defaults() -> dict[str, dict]:
    """{dataset kind: {key: default}}, from each kind's branch of the activation spec's dataset schema."""
    defaults = {}
    for branch in load_schema()["$defs"]["activation_spec"]["properties"]["dataset"]["allOf"]:
        props = branch["then"]["properties"]
        kind = branch["if"]["properties"]["kind"]["const"]
        defaults[kind] = {key: copy.deepcopy(sub["default"]) for key, sub in props.items() if "default" in sub}
    return defaults


def section_properties(section: str) -> dict:
    """The schema of each key of one top-level settings section (`inference`, `visuals`, `train`)."""
    return load_schema()["properties"][section]["properties"]


def section_defaults(section: str) -> dict:
    """The schema defaults of one top-level section's keys (so dataclass and CLI defaults have one source)."""
    return {key: copy.deepcopy(sub["default"]) for key, sub in section_properties(section).items() if "default" in sub}


def enum(where: str, *path: str) -> tuple:
    """The allowed values of an enumerated key: `where` is a `$defs` entry or a top-level section, `path` the keys
    under it, e.g. ("sae_spec", "arch"), ("export_spec", "lmprobe", "storage"), ("visuals", "selection"). A key that
    also takes a list of its values (a sweep, `train.tracking`) gives the values' enum; a dataset key is looked up
    in its kind's branch: ("activation_spec", "dataset", "segmentation_folder", "label_rule")."""
    schema = load_schema()
    node = schema["$defs"][where] if where in schema["$defs"] else schema["properties"][where]
    for key in path:
        props = node.get("properties", {})
        node = props[key] if key in props else _dataset_branch(node, key)
    while "enum" not in node:
        node = node["items"] if "items" in node else next(sub for sub in node["oneOf"] if "enum" in sub)
    return tuple(node["enum"])


def by_enum(table: dict, where: str, *path: str) -> dict:
    """`table`, whose keys are every value of the enum `enum(where, *path)` and no other, checked when the module that
    holds it is imported: the schema stays the one list of a key's values (a value added there without an entry here,
    or an entry the schema lacks, fails every command at once), and code maps each value to its behaviour."""
    values = enum(where, *path)
    if set(table) != set(values):
        missing, extra = sorted(set(values) - set(table)), sorted(set(table) - set(values))
        raise SaeflowError(f"saeflow's table for {'.'.join((where, *path))} does not match the schema's enum: "
                           f"missing {missing}, not in the schema {extra}")  # fmt: skip
    return table


def _dataset_branch(node: dict, kind: str) -> dict:
    """The `then` of the dataset schema's branch for one kind (each kind's own keys live there)."""
    return next(b["then"] for b in node["allOf"] if b["if"]["properties"]["kind"]["const"] == kind)


_ARG_TYPES = {"integer": int, "number": float, "string": str}


def option_flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_section_options(parser: argparse.ArgumentParser, section: str) -> None:
    """One option per key of a settings section: its flag, type, choices, default and help all from the schema."""
    for key, sub in section_properties(section).items():
        kwargs = {"dest": key, "default": copy.deepcopy(sub.get("default")), "help": sub.get("description", "")}
        if "enum" in sub:
            kwargs["choices"] = sub["enum"]
        elif sub.get("type") == "boolean":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif sub.get("type") == "array":
            kwargs.update(nargs="+", type=_ARG_TYPES[sub["items"]["type"]], metavar=key.upper().rstrip("S"))
        else:
            kwargs["type"] = _ARG_TYPES[sub["type"]] if isinstance(sub["type"], str) else str  # [string, integer]
        kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(option_flag(key), **kwargs)


def section_flags(section: str, values: dict) -> list[str]:
    """The command-line flags that set a section's `values` (validated config), omitting the defaults."""
    flags = []
    for key, value in values.items():
        if value == section_properties(section)[key].get("default"):
            continue
        if isinstance(value, bool):
            flags.append(option_flag(key) if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [option_flag(key), *(str(v) for v in (value if isinstance(value, list) else [value]))]
    return flags


def from_args(cls, args: argparse.Namespace, **overrides):
    """A settings dataclass from parsed arguments whose names are its fields (no field is copied by hand)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**{**values, **overrides})


def export_defaults(cls, *sections: str | None) -> dict:
    """The schema defaults of dataclass `cls`'s fields, from an `exports.<name>` entry's own keys (section None)
    and from its sections ("model", "lmprobe", "zarr", "pickle"), later sections winning."""
    props = load_schema()["$defs"]["export_spec"]["properties"]
    names = {f.name for f in dataclasses.fields(cls)}
    found = {}
    for section in sections:
        section_props = props if section is None else props[section]["properties"]
        for key, prop in section_props.items():
            if key in names and "default" in prop:
                found[key] = copy.deepcopy(prop["default"])
    return found


def validate_entry(obj: dict, def_name: str) -> dict:
    """A copy of `obj`, validated against `$defs.<def_name>` and filled with its defaults (the caller's dict stays)."""
    return validate(copy.deepcopy(obj), def_schema(def_name))
