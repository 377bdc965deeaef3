"""Every config/examples/*.yaml plans as shipped, and the README's commands run as written (issue 40).

Each example file itself is given to `saeflow plan` and to `snakemake -n --configfile`, read by saeflow's own
loader: its models come from a Hugging Face cache made here (tiny random checkpoints under the example's own model
names, offline), and a second config file points only its datasets (and the roots) at small local ones, merged
as Snakemake merges several --configfile files.
"""

import re
import subprocess

import pytest

from saeflow import cli, config
from workflow_helpers import (
    EXAMPLES_DPATH,
    REPO_ROOT,
    SNAKEFILE,
    VENV_BIN,
    env,
    example_hf_home,
    example_overrides,
    write_config,
)

EXAMPLES = sorted(EXAMPLES_DPATH.glob("*.yaml"))
README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


@pytest.fixture(scope="module")
def hf_env(tmp_path_factory) -> dict[str, str]:
    """One Hugging Face cache holding every model the examples name (a name it cannot make fails here)."""
    names = {spec["model"]["name"] for f in EXAMPLES for spec in config.read_yaml(f)["activations"].values()}
    return example_hf_home(tmp_path_factory.mktemp("hf"), sorted(names))


def _overrides(tmp_path, example_fpath):
    return write_config(tmp_path, example_overrides(tmp_path, config.read_yaml(example_fpath)), "overrides.yaml")


def _no_traceback(stderr: str) -> None:
    assert not any(line.startswith("Traceback") or line.lstrip().startswith('File "') for line in
                   stderr.splitlines()), stderr  # fmt: skip


def saeflow_plan(config_fpaths, hf_env) -> dict[str, dict[str, list[str]]]:
    """`saeflow plan A B` (the CLI): {"activation" | "run": {each name it lists: the ids on its lines}} (an
    activation of several layers has a line, and a directory, per layer: `activation NAME layer L: HASH`)."""
    argv = [str(VENV_BIN / "saeflow"), "plan", *map(str, config_fpaths)]
    proc = subprocess.run(argv, env=env(**hf_env), capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc.stderr)
    listed = {"activation": {}, "run": {}}
    for line in proc.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in listed:
            name, _, ids = rest.partition(": ")
            name = name.partition(" layer ")[0] if kind == "activation" else name
            listed[kind].setdefault(name, []).extend(HEX64.findall(ids))
    return listed


def snakemake_dry_run(argv: list[str], workdir, hf_env) -> str:
    proc = subprocess.run([*argv, "--directory", str(workdir), "-n"], env=env(**hf_env), capture_output=True,
                          text=True, cwd=REPO_ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_traceback(proc.stderr)
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("example_fpath", EXAMPLES, ids=[f.name for f in EXAMPLES])
def test_each_example_plans_as_shipped_under_saeflow_plan_and_snakemake(tmp_path, hf_env, example_fpath):
    """The shipped file, not a rewritten copy: its activations and every SAE's runs are planned, and snakemake -n
    plans the same shard directories and runs."""
    example = config.read_yaml(example_fpath)
    overrides_fpath = _overrides(tmp_path, example_fpath)
    listed = saeflow_plan([example_fpath, overrides_fpath], hf_env)
    assert set(listed["activation"]) == set(example["activations"])
    assert {name.partition("[")[0] for name in listed["run"]} == set(example["saes"])
    out = snakemake_dry_run([str(VENV_BIN / "snakemake"), "-s", str(SNAKEFILE), "--cores", "2", "--configfile",
                             str(example_fpath), str(overrides_fpath)], tmp_path, hf_env)  # fmt: skip
    planned = {*HEX64.findall(out)}  # a layer's directory appears where a job reads it
    assert all(set(ids) & planned for ids in listed["activation"].values()), out
    assert all(set(ids) <= planned for ids in listed["run"].values()), out


def test_saeflow_plan_merges_config_files_as_snakemake_merges_configfiles(tmp_path):
    """`saeflow plan A B`: B's mappings merge into A's key by key, its other values win, as in
    `snakemake --configfile A B` (the same update_config)."""
    from snakemake.utils import update_config

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("activations:\n  x: {layers: [1], dataset: {kind: text, path: /a, field: text}}\nsaes: {}\n")
    b.write_text("activations:\n  x: {dataset: {path: /b}}\nshards_root: s\n")
    expected = config.read_yaml(a)
    update_config(expected, config.read_yaml(b))
    merged, files = config.read_files([a, b])
    assert merged == expected == {"activations": {"x": {"layers": [1], "dataset": {"kind": "text", "path": "/b",
                                                                                  "field": "text"}}},
                                  "saes": {}, "shards_root": "s"}  # fmt: skip
    assert [fpath for fpath, _ in files] == [str(a), str(b)]


# -- the README's commands -----------------------------------------------------------------------------------------

CODE_SPANS = re.findall(r"`([^`\n]+)`", README)
INDENTED_COMMANDS = [line.strip() for line in README.splitlines() if re.match(r" {4,}(snakemake|saeflow) ", line)]
README_COMMANDS = [c for c in CODE_SPANS + INDENTED_COMMANDS if c.startswith(("snakemake ", "saeflow "))]
# The example runs the README shows, but for those through the OSC profile (Slurm): installed on a login node only.
EXAMPLE_RUNS = sorted({c for c in README_COMMANDS if "config/examples/" in c and "--profile" not in c})
SUBCOMMANDS = sorted({m for c in README_COMMANDS for m in re.findall(r"^saeflow ([a-z][a-z-]+)", c)})


def test_the_readme_lists_every_example_and_only_those():
    assert set(re.findall(r"config/examples/[\w.-]+\.yaml", README)) == {
        str(f.relative_to(REPO_ROOT)) for f in EXAMPLES
    }


def test_saeflow_help_lists_every_command_the_readme_names(capsys):
    """`saeflow --help`, as the README says to run it."""
    assert "saeflow --help" in README_COMMANDS
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(subcommand in out for subcommand in SUBCOMMANDS), out


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_each_saeflow_command_the_readme_names_exists_and_explains_itself(subcommand, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([subcommand, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: saeflow {subcommand}")


def test_the_readme_names_the_saeflow_commands_it_documents():
    """The parse above finds the commands (a README edit that hides them fails here, not silently)."""
    assert {"plan", "extract", "create-run", "train", "evaluate", "summary", "install-profile"} <= set(SUBCOMMANDS)
    assert EXAMPLE_RUNS, README_COMMANDS


@pytest.mark.slow
@pytest.mark.parametrize("command", EXAMPLE_RUNS)
def test_each_example_run_the_readme_shows_plans_as_written(tmp_path, hf_env, command):
    """The README's own command line, with `-n`, its working directory elsewhere and, after the example on its
    --configfile, the file that points its datasets and roots at local ones."""
    argv = command.split()
    assert argv[0] == "snakemake" and "--configfile" in argv, command
    at = argv.index("--configfile") + 1
    example_fpath = REPO_ROOT / argv[at]
    argv[at + 1 : at + 1] = [str(_overrides(tmp_path, example_fpath))]
    out = snakemake_dry_run([str(VENV_BIN / "snakemake"), *argv[1:]], tmp_path, hf_env)  # the repo's Snakefile
    assert "Job stats:" in out and "create_run" in out, out
