"""saeflow.planning.WorkflowPlan: what the workflow will run and where it writes, from the config alone.

The plans here come from the checked-in smallest config (.test/config/config.yaml: random-init models), so they
cost no model weights; the workflow tests run the same plans through Snakemake.
"""

import argparse
import copy
import os
import subprocess

import pytest
import yaml

from saeflow import cli, config
from saeflow.analysis import stability
from saeflow.errors import SaeflowError
from saeflow.extraction.specs import ShardsSpec
from saeflow.planning import WorkflowPlan, expand_path, has_labels, read_planned, sae_subconfig
from saeflow.store.layout import ShardLayout
from workflow_helpers import REPO_ROOT, VENV_BIN, env, minilm_path, snakemake_cmd

TEST_CONFIG = yaml.safe_load((REPO_ROOT / ".test" / "config" / "config.yaml").read_text())


def smallest_config(tmp_path=None, **changes) -> dict:
    cfg = copy.deepcopy(TEST_CONFIG)
    if tmp_path is not None:
        cfg.update(shards_root=str(tmp_path / "shards"), runs_root=str(tmp_path / "runs"))
    cfg.update(changes)
    return config.validate(cfg)


def test_every_sweep_point_is_a_run_with_a_dump_on_its_validation_shards():
    plan = WorkflowPlan.from_config(smallest_config())
    assert sorted((p.sae_name, p.index) for p in plan.runs.values()) == [
        ("images-relu", 0), ("text-topk", 0), ("text-topk", 1),
    ]  # fmt: skip
    assert len(set(plan.runs)) == 3
    assert sorted(plan.dumps()) == sorted(
        (run_id, plan.shard_hash[p.val_activation]) for run_id, p in plan.runs.items()
    )


def test_sweep_points_are_named_by_what_varies(tmp_path, capsys):
    """A point's name holds the values of its swept keys (alphabetically, seeds last: not the config's key order), not
    its index; its seed group's name drops the seeds; an unswept spec is its own name. `saeflow plan` and the
    summary's labels use these names."""
    swept = {**TEST_CONFIG["saes"]["text-topk"], "seed": [0, 1], "matryoshka": [[0.25], []]}
    cfg = smallest_config(saes={**TEST_CONFIG["saes"], "text-topk": swept})
    plan = WorkflowPlan.from_config(cfg)
    names = {p.name: p.group_name for p in plan.runs.values()}
    assert names == {
        "images-relu": "images-relu",
        **{f"text-topk[k={k},matryoshka={m},seed={seed}]": f"text-topk[k={k},matryoshka={m}]"
           for k in (4, 8) for m in ("[0.25]", "[]") for seed in (0, 1)},
    }  # fmt: skip
    summary_config = plan.cli_configs()[plan.cli_config("stages", "summary")]
    assert summary_config["labels"] == {run_id: p.name for run_id, p in plan.runs.items()}
    assert summary_config["group_labels"] == {run_id: p.group_name for run_id, p in plan.runs.items()}
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    assert cli.main(["plan", str(config_fpath)]) == 0
    printed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert sorted(printed) == sorted(f"run {name}" for name in names)


def test_saeflow_plan_and_snakemake_n_name_each_run_beside_its_id_with_a_transcoders_target(tmp_path, capsys):
    """Issue 40: `snakemake -n` named runs only by 64-hex ids, and a transcoder's `saeflow plan` line did not show its
    target. Both now print `run <name>: <run id> (train .., val .., target .., val_target ..)` (planning.describe_run),
    the dry run for each run still to train."""
    from workflow_helpers import snakemake, write_config

    mlp_out = {**TEST_CONFIG["activations"]["text"], "hook": "mlp_out"}
    transcoder = {**TEST_CONFIG["saes"]["text-topk"], "k": 4, "target": "text-mlp-out", "skip": [False, True]}
    cfg = smallest_config(tmp_path, activations={**TEST_CONFIG["activations"], "text-mlp-out": mlp_out},
                          saes={**TEST_CONFIG["saes"], "transcoder": transcoder})  # fmt: skip
    plan = WorkflowPlan.from_config(cfg)
    expected = {f"run transcoder[skip={skip}]: {run_id} (train text, val text, target text-mlp-out, val_target "
                f"text-mlp-out)" for run_id, p in plan.runs.items() if p.sae_name == "transcoder"
                for skip in [str(p.train_config.skip).lower()]}  # fmt: skip
    expected |= {f"run {p.name}: {run_id} (train {p.train_activation}, val {p.val_activation})"
                 for run_id, p in plan.runs.items() if p.sae_name != "transcoder"}  # fmt: skip
    config_fpath = write_config(tmp_path, cfg)
    assert cli.main(["plan", str(config_fpath)]) == 0
    assert {line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")} == expected
    proc = snakemake(tmp_path, config_fpath, "-n")
    said = {line.removeprefix("saeflow: to train: ") for line in (proc.stdout + proc.stderr).splitlines()
            if line.startswith("saeflow: to train: ")}  # fmt: skip
    assert said == expected and len(said) == len(plan.runs) == 5


def test_identical_activation_specs_share_one_shard_directory_named_for_the_first():
    cfg = smallest_config()
    cfg["activations"]["text-again"] = copy.deepcopy(cfg["activations"]["text"])
    plan = WorkflowPlan.from_config(cfg)
    assert plan.shard_hash["text-again"] == plan.shard_hash["text"]
    assert plan.hash_activation[plan.shard_hash["text"]] == "text"
    assert sum(1 for p in plan.cli_configs() if p.parts[0] == "shards") == 2


def test_each_job_config_holds_only_what_that_job_reads_and_is_rewritten_only_on_change(tmp_path):
    plan = WorkflowPlan.from_config(smallest_config())
    configs = plan.cli_configs()
    text_hash = plan.shard_hash["text"]
    assert list(configs[plan.cli_config("shards", text_hash)]["activations"]) == ["text"]
    for run_id, run_plan in plan.runs.items():
        assert list(configs[plan.cli_config("runs", run_id)]["saes"]) == [run_plan.sae_name]
    plan.write_cli_configs(tmp_path)
    fpath = tmp_path / plan.cli_config("shards", text_hash)
    mtime_ns = fpath.stat().st_mtime_ns
    WorkflowPlan.from_config(smallest_config()).write_cli_configs(tmp_path)
    assert fpath.stat().st_mtime_ns == mtime_ns
    written = config.validate(yaml.safe_load(fpath.read_text()))
    assert written["activations"]["text"] == smallest_config()["activations"]["text"]


def test_targets_are_every_runs_checkpoint_every_dumps_visuals_and_the_summary(tmp_path):
    plan = WorkflowPlan.from_config(smallest_config(tmp_path))
    targets = plan.targets()
    passes = set(plan.train_passes.values())  # nothing trained yet: every run is in a pass
    assert sorted(map(len, passes)) == [1, 2], passes  # the 2-point TopK sweep in one, the other SAE alone
    assert len(targets) == 2 * len(plan.runs) + len(passes) + 2
    for run_id in plan.runs:
        assert plan.run(run_id).config_fpath in targets
        assert plan.run(plan.trained_by(run_id)).sae_fpath in targets  # the pass's representative stands for it
    for run_id, shard_hash in plan.dumps():
        assert plan.run(run_id).dump(shard_hash).index_fpath in targets


def test_passes_are_made_of_untrained_runs_that_read_identical_batches(tmp_path):
    cfg = smallest_config(tmp_path)
    cfg["train"]["runs_per_pass"] = 1
    assert sorted(map(len, WorkflowPlan.from_config(cfg).train_passes.values())) == [1, 1, 1]
    plan = WorkflowPlan.from_config(smallest_config(tmp_path))
    (sweep,) = {members for members in plan.train_passes.values() if len(members) == 2}
    assert sweep[-1] == min(sweep)  # the representative (its sae.pt is published last) is the smallest run id
    for run_id in sweep:  # once trained, a run is in no pass and stands for itself
        plan.run(run_id).sae_fpath.parent.mkdir(parents=True)
        plan.run(run_id).sae_fpath.write_bytes(b"trained")
    plan = WorkflowPlan.from_config(smallest_config(tmp_path))
    assert not set(sweep) & set(plan.train_passes) and all(plan.trained_by(run_id) == run_id for run_id in sweep)
    assert len(plan.train_passes) == 1  # the other SAE, still untrained


def test_a_purged_shard_directory_is_reported_for_the_runs_built_on_it(tmp_path):
    plan = WorkflowPlan.from_config(smallest_config(tmp_path))
    assert plan.purged_shard_warnings() == []
    run_id = next(r for r, p in plan.runs.items() if p.train_activation == "images")
    plan.run(run_id).config_fpath.parent.mkdir(parents=True)
    plan.run(run_id).config_fpath.write_text("{}")
    (warning,) = plan.purged_shard_warnings()
    assert "'images'" in warning and run_id[:12] in warning and "purged" in warning


def test_an_sae_on_an_unknown_activation_is_refused_naming_its_key():
    cfg = smallest_config()
    cfg["saes"]["text-topk"]["train"] = "nope"
    with pytest.raises(SaeflowError, match="text-topk.*'nope'"):
        WorkflowPlan.from_config(cfg)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["activations"].update(shards={"shards": "a" * 64, "hook": "mlp_out"}),
         r"^activations\.shards: hook: 'mlp_out' on a shards entry, which is extracted already \(its directory's "
         r"metadata says what it stores\); remove hook$"),
        (lambda c: c["saes"]["text-topk"].update(target="text"),
         r"^saes\.text-topk: target: 'text' is the activation the transcoder reads; a transcoder predicts another "
         r"one \(leave target out for an SAE of it\)$"),
        (lambda c: c["saes"]["text-topk"].update(target="images", val="images", val_target="images"),
         r"^saes\.text-topk: val_target: 'images' is the activation the transcoder reads"),
        (lambda c: c["saes"].update({"Text-TopK": c["saes"]["text-topk"]}),
         r"^saes: 'text-topk' and 'Text-TopK' differ only by case, which a case-insensitive filesystem takes for one "
         r"name; rename one$"),
        (lambda c: c["activations"].update(TEXT=c["activations"]["text"]), r"^activations: 'text' and 'TEXT' differ"),
    ],
    ids=["hook-on-shards", "target-is-train", "val_target-is-val", "sae-names-by-case", "activation-names-by-case"],
)  # fmt: skip
def test_config_edges_are_refused_in_one_line_naming_the_key(edit, message):
    """Issue 41: each was accepted, and ignored (a shards entry's hook), planned a transcoder of its own input, or
    lost one name of two a case-insensitive filesystem cannot tell apart."""
    cfg = smallest_config()
    edit(cfg)
    with pytest.raises(SaeflowError, match=message):
        WorkflowPlan.from_config(config.validate(cfg))


def test_matryoshka_prefixes_are_one_run_in_any_order_and_each_once():
    """Issue 41: [0.5, 0.25] and [0.25, 0.25, 0.5] trained as [0.25, 0.5] (sorted, each once) under run ids of their
    own; they are one run now, the id of the sorted list, which kept its id (tests/test_identity.py)."""
    cfg = smallest_config()
    cfg["saes"]["text-topk"].update(k=4, matryoshka=[[0.25, 0.5], [0.5, 0.25], [0.25, 0.25, 0.5]])
    (plan,) = [p for p in WorkflowPlan.from_config(config.validate(cfg)).runs.values() if p.sae_name == "text-topk"]
    assert plan.same_points == (1, 2) and plan.train_config.to_dict()["matryoshka"] == [0.25, 0.5]
    cfg["saes"]["text-topk"].update(matryoshka=[0.25, 0.5])
    assert plan.run_id in WorkflowPlan.from_config(config.validate(cfg)).runs


def test_a_root_naming_an_unset_variable_is_refused_naming_its_key(monkeypatch):
    monkeypatch.delenv("SAEFLOW_UNSET_ROOT", raising=False)
    with pytest.raises(SaeflowError, match="shards_root: .*not set"):
        expand_path("$SAEFLOW_UNSET_ROOT/shards", "shards_root")
    monkeypatch.delenv("USER", raising=False)
    assert expand_path("/x/$USER", "runs_root").name == os.environ["USER"]


@pytest.mark.parametrize("section", ["train", "inference", "visuals", "evaluate", "probe"])
def test_settings_reach_the_cli_as_flags_that_parse_back_to_the_same_values(section):
    values = config.section_defaults(section)
    changed = {"train": {"checkpoint_every": 7}, "inference": {"top_k": 3, "device": "cpu"},
               "visuals": {"selection": "list", "latents": [3, 1]},
               "evaluate": {"n_tokens": 512, "compute_dtype": "bfloat16"},
               "probe": {"seed": 3, "test_frac": 0.5, "ks": [1, 3]}}[section]  # fmt: skip
    values.update(changed)
    flags = config.section_flags(section, values)
    assert len(flags) == sum(1 + len(v) if isinstance(v, list) else 2 for v in changed.values())
    parser = argparse.ArgumentParser()
    config.add_section_options(parser, section)
    assert vars(parser.parse_args(flags)) == values


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["saes"]["text-topk"].update(layer=0), r"saes\.text-topk\[0\]\.layer: layer 0 is not extracted "
                                                           r"by the train activation 'text'"),
        (lambda c: c["saes"]["text-topk"].update(k=[4, 65]), r"saes\.text-topk\[1\]\.k: k=65 must be in "
                                                             r"\[1, d_sae=64\] for topk \(d_sae = expansion 2 x "
                                                             r"d_model 32\)"),
        (lambda c: c["saes"]["text-topk"].update(tokens="cls"), r"saes\.text-topk\[0\]\.tokens: 'cls' asked for, but "
                                                                r"the train activation 'text' has no CLS token"),
        (lambda c: (c["saes"]["text-topk"].update(val="images"), c["activations"]["images"].update(layers=[0])),
         r"saes\.text-topk\[0\]\.layer: layer 1 is not extracted by the val activation 'images'"),
        (lambda c: (c["saes"]["text-topk"].update(val="images", tokens="content"),
                    c["activations"]["images"]["model"]["random"]["config"].update(hidden_size=48)),
         r"saes\.text-topk\[0\]\.val: activation 'images' has d_model 48, but the train activation 'text' has 32"),
        (lambda c: c["saes"]["text-topk"].update(val="images"),  # tokens: auto is no_special for the text
         r"saes\.text-topk\[0\]\.tokens: 'no_special' .* the val activation 'images' records none"),
    ],
    ids=["layer", "k", "tokens", "val-layer", "d_model", "no_special-val"],
)  # fmt: skip
def test_what_training_would_refuse_is_refused_at_plan_time_naming_the_key(edit, message):
    cfg = smallest_config()
    edit(cfg)
    with pytest.raises(SaeflowError, match=message):
        WorkflowPlan.from_config(config.validate(cfg))


def test_one_sae_is_planned_from_its_own_activations_only():
    """`saeflow create-run --sae NAME` plans that SAE's runs, not the whole config: another SAE's activation that
    cannot be planned (a missing model) does not stand in its way, and the runs are the ones the whole plan has."""
    cfg = config.validate(copy.deepcopy(TEST_CONFIG))
    whole = {r for r, p in WorkflowPlan.from_config(cfg).runs.items() if p.sae_name == "text-topk"}
    cfg["activations"]["images"]["model"] = {"name": "/nonexistent/model"}
    sub = sae_subconfig(cfg, "text-topk")
    assert list(sub["activations"]) == ["text"] and list(sub["saes"]) == ["text-topk"] and sub["exports"] == {}
    assert set(WorkflowPlan.from_config(sub).runs) == whole


def test_extract_and_create_run_expand_vars_in_roots_as_the_planner_does(tmp_path, monkeypatch, capsys):
    """`saeflow extract` and `saeflow create-run` on their own (not through the workflow) put a config's
    `$VAR/...` roots, and roots given as options, where the plan puts them: expanded, never a literal `$VAR` dir."""
    monkeypatch.setenv("SAEFLOW_TEST_ROOT", str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg.update(shards_root="$SAEFLOW_TEST_ROOT/shards", runs_root="$SAEFLOW_TEST_ROOT/runs")
    cfg["activations"] = {"text": cfg["activations"]["text"]}
    cfg["saes"] = {"text-topk": cfg["saes"]["text-topk"]}
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    plan = WorkflowPlan.from_config(config.load(config_fpath))
    assert plan.cfg.shards_root == tmp_path / "root" / "shards"

    assert cli.main(["extract", str(config_fpath), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == str(plan.shard(plan.shard_hash["text"]).dpath)
    assert cli.main(["create-run", str(config_fpath), "--sae", "text-topk", "--index", "0"]) == 0
    run = plan.run(next(r for r, p in plan.runs.items() if p.index == 0))
    assert capsys.readouterr().out.strip() == str(run.root) and run.config_fpath.is_file()
    assert run.link("train-shards").resolve() == plan.shard(plan.shard_hash["text"]).dpath
    other = ["--runs-root", "$SAEFLOW_TEST_ROOT/other", "--shards-root", "~/shards"]
    monkeypatch.setenv("HOME", str(tmp_path / "root"))
    assert cli.main(["create-run", str(config_fpath), "--sae", "text-topk", "--index", "1", *other]) == 0
    assert capsys.readouterr().out.strip().startswith(str(tmp_path / "root" / "other") + "/")
    assert not list(tmp_path.glob("$*")) and not list(tmp_path.glob("~*"))  # no literal "$SAEFLOW_TEST_ROOT" dir

    monkeypatch.delenv("SAEFLOW_TEST_ROOT")
    assert cli.main(["extract", str(config_fpath), "--no-progress"]) == 1
    assert "shards_root: '$SAEFLOW_TEST_ROOT/shards' names an environment variable that is not set" in (
        capsys.readouterr().err
    )


ARCH_VALUES = ", ".join(repr(arch) for arch in config.enum("sae_spec", "arch"))  # 'relu', 'topk', ...
SCHEMA_ERRORS = [  # issue 33: (key of saes.text-topk, value, the line `saeflow plan` prints after the file's name)
    ("arch", "top-k", f"saes.text-topk.arch: 'top-k' is not valid: expected one of {ARCH_VALUES}, or a non-empty "
    "list of them; did you mean 'topk'?"),
    ("arch", ["topk", "relu2"], f"saes.text-topk.arch[1]: 'relu2' is not one of {ARCH_VALUES}; did you mean 'relu'? "
    f"(the key takes one of {ARCH_VALUES}, or a non-empty list of them)"),
    ("k", [4, 8, "sixteen"], "saes.text-topk.k[2]: 'sixteen' is not an integer >= 1 (the key takes an integer >= 1, "
    "or a non-empty list of them)"),
    ("lr_warmup_frac", 2.0, "saes.text-topk.lr_warmup_frac: 2.0 is not valid: expected a number in [0, 1], or a "
    "non-empty list of them"),
    ("matryoshka", [[0.5, 2]], "saes.text-topk.matryoshka[0][1]: 2 is not a number in (0, 1) (the key takes a list "
    "of (a number in (0, 1)), or a non-empty list of them)"),
    ("expanson", 4, "saes.text-topk.expanson: unknown key 'expanson'; did you mean 'expansion'?"),
    ("zzz", 4, "saes.text-topk.zzz: unknown key 'zzz'; the keys here are "),
]


@pytest.mark.parametrize(("key", "value", "line"), SCHEMA_ERRORS, ids=[f"{k}={v}" for k, v, _ in SCHEMA_ERRORS])
def test_a_schema_error_says_in_one_line_what_is_valid(tmp_path, capsys, key, value, line):
    """Every enum error lists the valid values, a swept list names its bad element and the expected type, an unknown
    key gets the nearest known key (the Snakefile validates through the same config.check; tests/test_workflow.py)."""
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["saes"]["text-topk"][key] = value
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    assert cli.main(["plan", str(config_fpath)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    prefix = f"saeflow plan: error: config file {config_fpath}: config does not match the schema: "
    assert err.startswith(prefix + line), err


MERGED = """\
base: &base {layers: [4], hook: mlp_in, batch_size: 8}
other: &other {hook: attn_out, context_length: 16}
one:
  <<: *base
  layers: [5]
both:
  <<: [*base, *other]
  hook: mlp_out
  batch_size: 4
"""


def test_merge_keys_are_read_as_yaml_defines_them_and_as_snakemake_reads_them(tmp_path):
    """A mapping's own key overrides one it merges (`<<: *base`, `<<: [*a, *b]`): not a repeated key (issue 40)."""
    from snakemake.common.configfile import load_configfile

    fpath = tmp_path / "merged.yaml"
    fpath.write_text(MERGED)
    read = config.read_yaml(fpath)
    assert read["one"] == {"layers": [5], "hook": "mlp_in", "batch_size": 8}
    assert read["both"] == {"layers": [4], "hook": "mlp_out", "batch_size": 4, "context_length": 16}
    assert read == load_configfile(str(fpath)) == yaml.safe_load(MERGED)


@pytest.mark.parametrize(("text", "line"), [
    (MERGED + "  batch_size: 2\n", "line 10, column 3: found duplicate key 'batch_size' (first given on line 9)"),
    (MERGED + "  <<: *other\n", "line 10, column 3: found duplicate key '<<' (first given on line 7)"),
    (MERGED.replace("  hook: mlp_out\n", ""), "line 7, column 7: key 'hook' is merged from two mappings (lines 1 "
     "and 2), which YAML and PyYAML resolve differently: set it in the mapping itself"),
    ("one:\n  <<: {hook: mlp_in, hook: mlp_out}\n", "line 2, column 22: found duplicate key 'hook' (first given on "
     "line 2)"),
], ids=["own_key_twice", "merge_key_twice", "merged_twice_unset", "twice_in_a_merged_mapping"])  # fmt: skip
def test_a_key_written_twice_in_one_mapping_is_refused_with_its_line(tmp_path, text, line):
    fpath = tmp_path / "twice.yaml"
    fpath.write_text(text)
    with pytest.raises(SaeflowError) as err:
        config.read_yaml(fpath)
    assert str(err.value) == f"config file {fpath}: not valid YAML: {line}"


@pytest.mark.parametrize("command", ["saeflow", pytest.param("snakemake", marks=pytest.mark.slow)])
def test_an_exponent_number_yaml_reads_as_a_string_is_refused_saying_how_to_write_it(tmp_path, command):
    """Unquoted `lr: 3e-4` is a string in YAML 1.1 (PyYAML, so saeflow and Snakemake alike): the one line says to
    write 3.0e-4 (issue 40), in the file as a user writes it."""
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["saes"]["text-topk"]["lr"] = 0.000123
    cfg["saes"]["text-topk"]["n_train_vectors"] = [4096, 12345]
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg).replace("0.000123", "3e-4").replace("12345", "1e5"))
    assert "lr: 3e-4\n" in config_fpath.read_text()
    argv = {"saeflow": [str(VENV_BIN / "saeflow"), "plan", str(config_fpath)],
            "snakemake": [*snakemake_cmd(tmp_path, config_fpath), "-n"]}[command]  # fmt: skip
    proc = subprocess.run(argv, env=env(), capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith({"saeflow": "saeflow plan: error: ", "snakemake": "saeflow: "}[command] + f"config file "
                           f"{config_fpath}: config does not match the schema: "), line  # fmt: skip
    assert "saes.text-topk.lr: '3e-4' is not valid: expected null, a number >= 0, or a non-empty list of (a number " \
        ">= 0, or null); write 3.0e-4 (YAML 1.1 reads 3e-4 as a string)" in line
    assert "saes.text-topk.n_train_vectors[1]: '1e5' is not an integer >= 1, or null; write 100000 (YAML 1.1 reads " \
        "1e5 as a string)" in line


def test_saeflow_plan_prints_each_root_and_where_it_came_from(tmp_path, capsys):
    cfg = copy.deepcopy(TEST_CONFIG)
    del cfg["runs_root"], cfg["summary_dir"]
    cfg["default_roots"] = {"runs_root": str(tmp_path / "default-runs")}
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    assert cli.main(["plan", str(config_fpath)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        f"shards_root: results/shards (from config file {config_fpath})",
        f"runs_root: {tmp_path / 'default-runs'} (from default_roots (the profile's default))",
        "summary_dir: results/summary (from schema default)",
    ]


def test_the_storage_specs_environment_gives_the_roots_no_config_or_profile_gives(tmp_path, monkeypatch, capsys):
    """$SAEV_SCRATCH/saev/shards and $SAEV_NFS/saev/runs (storage-and-run-manifest-v1) where neither the config file
    nor the profile's default_roots gives the root; a config file's root and a profile's default beat them, and an
    empty variable counts as unset."""
    monkeypatch.setenv("SAEV_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("SAEV_NFS", str(tmp_path / "nfs"))
    cfg = copy.deepcopy(TEST_CONFIG)
    del cfg["shards_root"], cfg["runs_root"]
    config_fpath = tmp_path / "config.yaml"
    config_fpath.write_text(yaml.safe_dump(cfg))
    assert cli.main(["plan", str(config_fpath)]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"shards_root: {tmp_path}/scratch/saev/shards (from $SAEV_SCRATCH (the storage spec's environment))",
        f"runs_root: {tmp_path}/nfs/saev/runs (from $SAEV_NFS (the storage spec's environment))",
    ]
    loaded, sources = config.load_with_root_sources(config_fpath)
    assert WorkflowPlan.from_config(loaded).cfg.shards_root == tmp_path / "scratch" / "saev" / "shards"

    cfg.update(runs_root="mine", default_roots={"shards_root": "profile-shards"})
    config_fpath.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("SAEV_NFS", "")
    _, sources = config.load_with_root_sources(config_fpath)
    assert sources["shards_root"] == "default_roots (the profile's default)"
    assert sources["runs_root"] == f"config file {config_fpath}"
    del cfg["runs_root"]
    config_fpath.write_text(yaml.safe_dump(cfg))
    loaded, sources = config.load_with_root_sources(config_fpath)
    assert sources["runs_root"] == "schema default" and loaded["runs_root"] == "results/saev/runs"


def test_a_damaged_published_shard_directory_is_refused_only_while_a_job_still_reads_it(tmp_path):
    """A stat per file finds a deleted or truncated shard of a published directory that a run still has to read;
    once every run on it is complete (config, checkpoint, dump), nothing reads it and planning goes on."""
    from saeflow.extraction import extract
    from saeflow.store import layout

    cfg = smallest_config(tmp_path)
    cfg["activations"] = {"text": cfg["activations"]["text"]}
    cfg["saes"] = {"text-topk": cfg["saes"]["text-topk"]}
    plan = WorkflowPlan.from_config(cfg)
    spec = plan.cfg.activations["text"]
    dpath = extract.extract(spec, plan.cfg.shards_root, progress=False).dpath
    assert plan.shard_hashes_to_read() == [dpath.name]
    plan.check_published_shards()  # intact
    shard_fpath = layout.ShardLayout(dpath).shard_fpath(0)
    dpath.chmod(0o755)
    shard_fpath.chmod(0o644)
    with open(shard_fpath, "r+b") as fd:
        fd.truncate(shard_fpath.stat().st_size - 4)
    with pytest.raises(SaeflowError, match=rf"{dpath} \(activation 'text'\) is damaged and a job needs it: "
                                           rf"{shard_fpath}: \d+ bytes, expected \d+ \(truncated"):  # fmt: skip
        plan.check_published_shards()
    shard_fpath.unlink()
    with pytest.raises(SaeflowError, match=rf"{shard_fpath}: missing\. Remove it .*saeflow validate --deep {dpath}"):
        plan.check_published_shards()
    for run_id in plan.runs:  # every run complete: no job reads the directory any more
        run = plan.run(run_id)
        for fpath in (run.config_fpath, run.sae_fpath, run.dump(dpath.name).metrics_fpath):
            fpath.parent.mkdir(parents=True, exist_ok=True)
            fpath.touch()
    assert plan.shard_hashes_to_read() == []
    plan.check_published_shards()


def test_a_jobs_parse_takes_what_the_submitting_parse_planned_and_plans_a_changed_spec_again(tmp_path, monkeypatch):
    """A Slurm job's parse (common.smk) reads the shard metadata its Snakemake wrote beside the job configs: same
    hashes and runs, without planning an activation again; an entry is named by its spec's content, so an edited
    spec finds none and is planned anew."""
    from saeflow.extraction import extract

    cache_dpath = tmp_path / "cache"
    plan = WorkflowPlan.from_config(smallest_config(tmp_path))
    plan.write_cli_configs(cache_dpath)
    planned = read_planned(smallest_config(tmp_path)["activations"], cache_dpath)
    assert sorted(md["n_ex"] for md in planned.values()) == [32, 32]  # text and images
    with monkeypatch.context() as patched:
        patched.setattr(extract, "plan_activation", lambda spec: pytest.fail("an activation was planned again"))
        again = WorkflowPlan.from_config(smallest_config(tmp_path), planned)
    assert again.shard_hash == plan.shard_hash and again.runs.keys() == plan.runs.keys()
    edited = smallest_config(tmp_path)
    edited["activations"]["text"]["context_length"] = 8
    planned = read_planned(edited["activations"], cache_dpath)
    assert len(planned) == 1  # images only
    fresh = WorkflowPlan.from_config(edited, planned)
    assert fresh.shard_hash["images"] == plan.shard_hash["images"]
    assert fresh.shard_hash["text"] != plan.shard_hash["text"]
    assert fresh.activation_metadata["text"].patches_per_ex == 8


def test_only_dumps_of_labelled_shards_are_probed(tmp_path):
    """Generated images carry labels.bin (a shape per patch): their runs are probed; text runs are not. An existing
    shard directory is probed when it holds labels.bin or classes.bin."""
    plan = WorkflowPlan.from_config(smallest_config())
    images = plan.shard_hash["images"]
    assert plan.probes() and {h for _, h in plan.probes()} == {images}
    assert {r for r, _ in plan.probes()} == {r for r, p in plan.runs.items() if p.val_activation == "images"}
    shards = ShardLayout(tmp_path)
    assert not has_labels(ShardsSpec(str(tmp_path)), shards)
    shards.file(ShardLayout.CLASSES_FNAME).write_bytes(b"")
    assert has_labels(ShardsSpec(str(tmp_path)), shards)


def test_the_default_workflow_probes_its_generated_shapes(tmp_path, monkeypatch):
    """The default config's ViT runs on generated images, whose labels.bin holds the shape under each patch: its one
    dump is probed (the 16th job), the MiniLM runs are not; it sweeps no seeds, so there is no stability job."""
    link = tmp_path / "results" / "models" / "all-MiniLM-L6-v2"
    link.parent.mkdir(parents=True)
    link.symlink_to(minilm_path())
    monkeypatch.chdir(tmp_path)
    plan = WorkflowPlan.from_config(config.load(REPO_ROOT / "config" / "config.yaml"))
    (vit_run,) = [run_id for run_id, run_plan in plan.runs.items() if run_plan.sae_name == "vit-relu"]
    assert plan.probes() == [(vit_run, plan.shard_hash["vit-shapes"])]
    assert stability.seed_groups({r: p.train_config.to_dict() for r, p in plan.runs.items()}) == {}
