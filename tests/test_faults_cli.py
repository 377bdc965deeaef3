"""The fault matrix: broken inputs at every stage, each run as the real CLI in a subprocess, must end with exit
code 1 and exactly one stderr line `saeflow <command>: error: ...` naming the offending file or key, and never
a traceback (that takes `--debug`). Permission cases run the CLI without the right to read other users' files."""

import ctypes
import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from builders import identity_sae, make_acts, make_md, run_around_sae, run_from_sae_spec, write_shards
from hang import HANG_SEC
from saeflow.analysis import inference
from saeflow.store import atomic

WORKFLOW_DPATH = pathlib.Path(__file__).resolve().parents[1] / "workflow"
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2
NOBODY = 65534


# How the CLI runs: a subprocess, optionally unprivileged


def _setuid_nobody():
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _drop_dac_capabilities():
    """Root without the capabilities that bypass file permissions: mode 000 files are unreadable to it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _unprivileged_preexec():
    """A preexec_fn that makes the child an unprivileged reader, or None when we already are one.

    As root: uid 65534 when that user can run this interpreter, else (the interpreter lives under a 0700 home)
    root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH, which file permissions bind like any user. Skips when
    neither works.
    """
    if os.geteuid() != 0:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        secret = pathlib.Path(tmp) / "secret"
        secret.write_text("x")
        secret.chmod(0)
        os.chmod(tmp, 0o755)
        probe = [sys.executable, "-c", f"open({str(secret)!r})"]
        for preexec in (_setuid_nobody, _drop_dac_capabilities):
            try:
                proc = subprocess.run(probe, preexec_fn=preexec, capture_output=True, text=True, timeout=HANG_SEC)
            except (OSError, subprocess.SubprocessError):
                continue
            if proc.returncode == 1 and "PermissionError" in proc.stderr:
                return preexec
    pytest.skip("cannot drop the privileges that bypass file permissions")


def saeflow(*argv, unprivileged=False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(WORKFLOW_DPATH), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["MPLCONFIGDIR"] = tempfile.gettempdir()
    preexec = _unprivileged_preexec() if unprivileged else None
    return subprocess.run(
        [sys.executable, "-m", "saeflow", *map(str, argv)],
        capture_output=True, text=True, env=env, preexec_fn=preexec, timeout=HANG_SEC, cwd=tempfile.gettempdir(),
    )  # fmt: skip


def assert_one_line_error(proc: subprocess.CompletedProcess, command: str, names: str) -> str:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, (proc.returncode, out)
    assert len(lines) == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert lines[0].startswith(f"saeflow {command}: error: "), lines[0]
    assert str(names) in lines[0], (names, lines[0])
    return lines[0]


# The world every case damages: a shard directory, a trained-looking run on it, a run to train, an inference dump


@pytest.fixture
def world():
    """Built in a 0755 directory under /tmp (pytest's tmp_path parents are 0700: an unprivileged child could not
    traverse them)."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="saeflow-faults-"))
    root.chmod(0o755)
    try:
        md = make_md(n_ex=7, layers=(0,), ex_per_shard=3)
        sd = write_shards(root / "shards", make_acts(md, 0, 7), layers=(0,), cls_token=True, ex_per_shard=3)
        (root / "shards").chmod(0o755)
        run = run_around_sae(root / "runs", sd, identity_sae(md.d_model), layer=0)
        train_run = run_from_sae_spec(root / "train-runs", sd, expansion=2, k=2, aux_k=2, batch_size=8)
        yield {"root": root, "sd": sd, "run": run, "train_run": train_run}
    finally:
        atomic.make_tree_writable(root)
        shutil.rmtree(root)


def damage(path: pathlib.Path, fn) -> None:
    """Apply fn(path) inside a published (read-only) tree, as a user or a purge would."""
    parent = path.parent
    mode = parent.stat().st_mode
    parent.chmod(mode | 0o700)
    if path.exists() and not path.is_symlink():
        path.chmod(path.stat().st_mode | 0o200)
    fn(path)
    parent.chmod(mode)


def truncate(fpath):
    os.truncate(fpath, fpath.stat().st_size - 4)


def grow(fpath):
    with open(fpath, "ab") as f:
        f.write(b"\0" * 32)


def to_dir(fpath):
    fpath.unlink()
    fpath.mkdir()


def garble(fpath):
    fpath.write_bytes(b"\x80{ not json or anything")


def unreadable(fpath):
    fpath.chmod(0)


def edit_metadata(fpath):
    obj = json.loads(fpath.read_text())
    obj["ckpt"] = "hf-hub:test/other"
    fpath.write_text(json.dumps(obj))


def wrong_shards_json(fpath):
    fpath.write_text(json.dumps([{"name": "acts000000.bin", "n_ex": 7}]))


def checksums_not_a_mapping(fpath):
    fpath.write_text('{"files": [1, 2]}')


# Shard directory faults, seen through every command that opens one: (file, damage, what the error says)

SHARD_FAULTS = {
    "shard_truncated": ("acts000001.bin", truncate, "bytes, expected"),
    "shard_missing": ("acts000002.bin", os.unlink, "missing"),
    "shard_oversized": ("acts000000.bin", grow, "bytes, expected"),
    "shard_is_a_directory": ("acts000001.bin", to_dir, "is a directory, not a file"),
    "metadata_garbled": ("metadata.json", garble, "unreadable"),
    "metadata_edited": ("metadata.json", edit_metadata, "its sha256 is"),
    "shards_json_wrong": ("shards.json", wrong_shards_json, "lists 1 shards"),
    "checksums_garbled": ("checksums.json", garble, "unreadable"),
    "checksums_wrong_shape": ("checksums.json", checksums_not_a_mapping, "unreadable"),
}
SHARD_COMMANDS = {
    "validate": lambda w: ("validate", w["sd"].dpath),
    "validate-deep": lambda w: ("validate", "--deep", w["sd"].dpath),
    "info": lambda w: ("info", w["sd"].dpath),
    "train": lambda w: ("train", "--run", w["train_run"].root, "--device", "cpu"),
    "inference": lambda w: ("inference", "--run", w["run"].root, "--shards", w["sd"].dpath, "--device", "cpu"),
}
# The matrix: every fault through validate; the file-kind faults through every command.
SHARD_MATRIX = [(f, "validate") for f in SHARD_FAULTS] + [
    (fault, command)
    for fault in ("shard_truncated", "shard_is_a_directory", "metadata_garbled", "shards_json_wrong")
    for command in ("validate-deep", "info", "train", "inference")
]


@pytest.mark.parametrize(("fault", "command"), SHARD_MATRIX, ids=[f"{f}-{c}" for f, c in SHARD_MATRIX])
@pytest.mark.slow
def test_shard_directory_fault(world, fault, command):
    fname, fn, what = SHARD_FAULTS[fault]
    fpath = world["sd"].dpath / fname
    damage(fpath, fn)
    argv = SHARD_COMMANDS[command](world)
    line = assert_one_line_error(saeflow(*argv), argv[0], fpath)
    assert what in line


PERMISSION_MATRIX = [
    ("acts000001.bin", "validate"),
    ("acts000001.bin", "validate-deep"),
    ("acts000001.bin", "info"),
    ("metadata.json", "validate"),
    ("metadata.json", "train"),
    ("metadata.json", "inference"),
]


@pytest.mark.parametrize(("fname", "command"), PERMISSION_MATRIX, ids=[f"{f}-{c}" for f, c in PERMISSION_MATRIX])
@pytest.mark.slow
def test_unreadable_shard_file(world, fname, command):
    fpath = world["sd"].dpath / fname
    damage(fpath, unreadable)
    argv = SHARD_COMMANDS[command](world)
    line = assert_one_line_error(saeflow(*argv, unprivileged=True), argv[0], fpath)
    assert "cannot read (permission denied)" in line


def test_shallow_validate_reports_an_unreadable_shard_as_invalid(world):
    fpath = world["sd"].dpath / "acts000000.bin"
    damage(fpath, unreadable)
    proc = saeflow("validate", world["sd"].dpath, unprivileged=True)
    assert proc.returncode == 1 and "ok:" not in proc.stdout
    assert proc.stdout.startswith(f"invalid: {world['sd'].dpath}")
    assert f"{fpath}: cannot read (permission denied)" in proc.stdout
    assert_one_line_error(proc, "validate", fpath)


# Run faults: checkpoint/config.json, sae.pt, inference dumps


def _inference_argv(w):
    return ("inference", "--run", w["run"].root, "--shards", w["sd"].dpath, "--device", "cpu")


RUN_FAULTS = {
    "config_garbled-inference": (lambda w: w["run"].config_fpath, garble, _inference_argv, "not valid JSON"),
    "config_missing-inference": (lambda w: w["run"].config_fpath, os.unlink, _inference_argv, "missing"),
    "config_garbled-train": (
        lambda w: w["train_run"].config_fpath, garble,
        lambda w: ("train", "--run", w["train_run"].root, "--device", "cpu"), "not valid JSON",
    ),
    "config_missing-train": (
        lambda w: w["train_run"].config_fpath, os.unlink,
        lambda w: ("train", "--run", w["train_run"].root, "--device", "cpu"), "missing",
    ),
    "sae_garbled-inference": (lambda w: w["run"].sae_fpath, garble, _inference_argv, "not a readable SAE checkpoint"),
    "sae_is_a_directory-inference": (lambda w: w["run"].sae_fpath, to_dir, _inference_argv, "is a directory"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(RUN_FAULTS))
@pytest.mark.slow
def test_run_fault(world, case):
    target, fn, argv_of, what = RUN_FAULTS[case]
    fpath = target(world)
    damage(fpath, fn)
    argv = argv_of(world)
    line = assert_one_line_error(saeflow(*argv), argv[0], fpath)
    assert what in line


def _dump(world) -> pathlib.Path:
    cfg = inference.InferenceConfig(run=world["run"].root, shards=world["sd"].dpath, device="cpu", top_k=2)
    return inference.run_inference(cfg)


@pytest.mark.parametrize(("fname", "fn", "what"), [
    ("latents.npz", os.unlink, "missing; run `saeflow inference` first"),
    ("latents.npz", garble, "not a readable .npz archive"),
    ("metrics.json", garble, "not valid JSON"),
], ids=["latents_missing", "latents_garbled", "metrics_garbled"])  # fmt: skip
@pytest.mark.slow
def test_visuals_on_a_damaged_dump(world, fname, fn, what):
    dump_dpath = _dump(world)
    damage(dump_dpath / fname, fn)
    line = assert_one_line_error(saeflow("visuals", "--run", world["run"].root), "visuals", dump_dpath / fname)
    assert what in line


# Config faults, for `saeflow plan` and `saeflow create-run`

GOOD_SPEC = {"model": {"random": {"arch": "vit", "config": {"hidden_size": 32}}}, "layers": [0]}
CONFIG_FAULTS = {
    "yaml_syntax": ("activations:\n  a: {model: [1\nsaes: {}\n", "line 3"),
    "duplicate_key": ("activations: {}\nsaes: {}\nshards_root: a\nshards_root: b\n", "duplicate key 'shards_root'"),
    "unknown_key": ("activations: {}\nsaes: {}\nshard_root: x\n", "key 'shard_root'; did you mean 'shards_root'?"),
    "wrong_type": ("activations: []\nsaes: {}\n", "activations: [] is not of type 'object'"),
    "not_a_mapping": ("- 1\n- 2\n", "must hold a mapping"),
    "not_utf8": (b"activations: {}\nsaes: {}\n# \xff\xfe\n", "not UTF-8"),
}


@pytest.mark.parametrize("command", ["plan", "create-run"])
@pytest.mark.parametrize("case", sorted(CONFIG_FAULTS))
def test_malformed_config(world, case, command):
    text, what = CONFIG_FAULTS[case]
    fpath = world["root"] / "config.yaml"
    (fpath.write_bytes if isinstance(text, bytes) else fpath.write_text)(text)
    extra = ("--shards-root", world["root"] / "shards", "--runs-root", world["root"] / "runs")
    line = assert_one_line_error(saeflow(command, fpath, *(extra if command == "create-run" else ())), command, fpath)
    assert what in line


def test_sae_on_an_unknown_activation(world):
    fpath = world["root"] / "config.yaml"
    fpath.write_text("activations: {}\nsaes:\n  topk: {train: nope, val: nope, layer: 0}\n")
    argv = ("create-run", fpath, "--shards-root", world["root"] / "shards", "--runs-root", world["root"] / "runs")
    assert_one_line_error(saeflow(*argv), "create-run", "saes.topk: activation 'nope' is not defined")


def test_unreadable_config(world):
    fpath = world["root"] / "config.yaml"
    fpath.write_text("activations: {}\nsaes: {}\n")
    fpath.chmod(0)
    line = assert_one_line_error(saeflow("plan", fpath, unprivileged=True), "plan", fpath)
    assert "cannot read (permission denied)" in line


# The last-resort handler and --debug


@pytest.mark.slow
def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(world):
    """A fault nobody anticipated (here: a dump whose config.json lacks a key visuals needs) still ends in one
    line with the exception's type; --debug shows the traceback."""
    dump_dpath = _dump(world)
    cfg_fpath = dump_dpath / "config.json"
    damage(cfg_fpath, lambda f: f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items()
                                                          if k != "shards"})))  # fmt: skip
    proc = saeflow("visuals", "--run", world["run"].root)
    line = assert_one_line_error(proc, "visuals", "KeyError")
    assert line.endswith("(rerun with --debug for the traceback)")
    debug = saeflow("visuals", "--run", world["run"].root, "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "KeyError" in debug.stderr


def test_unexpected_os_error_names_its_file():
    from saeflow import cli

    err = PermissionError(13, "Permission denied", "/some/file")
    assert cli.unexpected(err) == "PermissionError: /some/file: Permission denied"
    assert cli.unexpected(MemoryError()) == "MemoryError: out of memory"
    assert cli.unexpected(ValueError("a\n  - b")) == "ValueError: a b"


@pytest.mark.slow
def test_debug_and_verbose_flags_are_accepted_before_and_after_the_command(world):
    dpath = world["sd"].dpath
    for argv in (("--debug", "validate", dpath), ("validate", dpath, "--debug"), ("-v", "validate", dpath)):
        proc = saeflow(*argv)
        assert proc.returncode == 0 and proc.stdout.startswith("ok:"), proc.stdout + proc.stderr
    damage(dpath / "acts000000.bin", to_dir)
    assert "Traceback" not in saeflow("-v", "info", dpath).stderr  # -v logs, but never shows tracebacks


def test_python_dash_m_saeflow_is_the_cli(tmp_path, monkeypatch, capsys):
    """`python -m saeflow` (what every rule runs) is the CLI with its exit status, here in this process."""
    missing = tmp_path / "missing"
    monkeypatch.setattr(sys, "argv", ["saeflow", "validate", str(missing)])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("saeflow", run_name="__main__")
    assert stopped.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("saeflow validate: error: ") and str(missing) in line, line


def test_error_lines_of_processes_sharing_stderr_never_interleave(tmp_path):
    """Ranks share their launcher's stderr (a terminal, a Slurm log). Each error line is one write: with `print` (the
    text, then its newline: two writes, Python's stderr is unbuffered) two ranks' lines ran together in one line.
    The writers start together (each says it is ready, then waits for the gate) and write 1,000 lines each."""
    code = ("import os, sys, time; from saeflow import cli; rank, gate = sys.argv[1], sys.argv[2]\n"
            "open(gate + rank, 'w').close()\n"
            "while not os.path.exists(gate): time.sleep(0.001)\n"
            "for _ in range(1000): cli.error('train', f'rank {rank}: ' + 'x' * 200)")  # fmt: skip
    gate = str(tmp_path / "gate")
    r, w = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), gate], stderr=w) for rank in range(4)]
    os.close(w)
    deadline = time.monotonic() + HANG_SEC
    while not all(os.path.exists(gate + str(rank)) for rank in range(4)) and time.monotonic() < deadline:
        time.sleep(0.01)
    pathlib.Path(gate).touch()
    with os.fdopen(r, encoding="utf-8") as shared:
        lines = shared.read().splitlines()
    for proc in procs:
        proc.wait(timeout=HANG_SEC)
    want = {f"saeflow train: error: rank {rank}: " + "x" * 200 for rank in range(4)}
    assert len(lines) == 4000 and set(lines) == want, [line[:60] for line in lines if line not in want][:3]
