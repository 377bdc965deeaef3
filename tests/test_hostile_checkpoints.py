"""Hostile SAE checkpoints (issue 41): `saeflow import-checkpoint` refuses each in one line naming the file and the
problem, writes nothing, and stays within its memory bound (docs/interop.md, "Import reads SRC as untrusted input").

The small cases are SAELens- and sparsify-made fixtures altered by tests/fixtures/hostile/make_hostile.py; the big
ones (gigabyte files, a FIFO, a device) are made here in the test's tmp dir, sparse where the content does not matter.
"""

import json
import os
import pathlib
import shutil
import struct
import sys

import numpy as np
import pytest
import safetensors.torch
import torch

from builders import write_shards
from peak_rss import run_measured
from saeflow import cli
from saeflow.interop.checkpoints import hooknames
from saeflow.training import sae

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HOSTILE = FIXTURES / "hostile"
STANDARD = FIXTURES / "saelens" / "accepted" / "standard"
# fixture -> (the file its refusal names, what it says)
REFUSED = {
    "saelens-nan-weight": ("sae_weights.safetensors", "tensor 'W_enc' holds 1 non-finite value (NaN or inf)"),
    "saelens-inf-threshold": ("sae_weights.safetensors", "tensor 'threshold' holds 1 non-finite value"),
    "sparsify-minus-inf-bias": ("sae.safetensors", "tensor 'encoder.bias' holds 2 non-finite values"),
    "saelens-float64-overflow": ("sae_weights.safetensors", "float64 tensor 'W_dec' holds 1e+300, which overflows "
                                                            "float32"),
    "saelens-float64-inexact": ("sae_weights.safetensors", "float64 tensor 'b_dec' holds 0.1, which is no float32 "
                                                           "value"),
    "saelens-int8-weights": ("sae_weights.safetensors", "is I8; saeflow reads float16, bfloat16 and float32"),
    "saelens-cfg-only-dtype": ("cfg.json", "no d_in, d_sae (a SAELens 'standard' cfg.json has d_in, d_sae)"),
    "saelens-jumprelu-tensors-no-architecture": ("sae_weights.safetensors", "a SAELens 'standard' SAE (saeflow relu; "
                                                 "cfg.json names no architecture: SAELens's default) does not use "
                                                 "tensor 'threshold'; refusing to drop it"),
    "saelens-skip-tensor-on-standard": ("sae_weights.safetensors", "a SAELens 'standard' SAE (saeflow relu) does not "
                                                                   "use tensor 'W_skip'"),
    "saelens-apply-b-dec-string": ("cfg.json", "apply_b_dec_to_input is the string 'false', not a JSON boolean"),
    "sparsify-transcode-string": ("cfg.json", "transcode is the string 'false', not a JSON boolean (true or false)"),
    "saelens-d-in-string": ("cfg.json", "d_in is the string '16', not a positive integer"),
    "saelens-apply-b-dec-null": ("cfg.json", "apply_b_dec_to_input is null, not a JSON boolean (true or false)"),
    "saelens-d-sae-2-40": ("sae_weights.safetensors", "has shape [32, 16], but cfg.json (d_in=16, "
                                                      "d_sae=1099511627776, d_out=16) makes it [1099511627776, 16]"),
    "saelens-k-above-d-sae": ("cfg.json", "k=1000 is more than the SAE's 32 latents"),
    "saelens-topk-without-k": ("cfg.json", "no k (a SAELens 'topk' cfg.json has d_in, d_sae, k)"),
    "sparsify-k-above-num-latents": ("cfg.json", "k=1000 is more than the SAE's 32 latents"),
    "saelens-hook-name-dotdot": ("cfg.json", "metadata.hook_name '../../etc/passwd' is not a SAELens hook name"),
    "saelens-hook-name-newline": ("cfg.json", "metadata.hook_name 'blocks.1.hook_resid_post\\nERROR: fake' is not a "
                                              "SAELens hook name"),
    "sparsify-hookpoint-dotdot": ("cfg.json", "saeflow.hookpoint '../layers.1' is not a sparsify hook name"),
    "saelens-shapes-disagree": ("sae_weights.safetensors", "tensor 'W_dec' has shape [31, 16], but cfg.json"),
    "saelens-offsets-overlap": ("sae_weights.safetensors", "tensor 'b_dec' declares bytes [4160, 4288], not "
                                                           "[4096, 4160]"),
    "saelens-trailing-bytes": ("sae_weights.safetensors", "8384 bytes of data, but its tensors take 4288"),
    "both-formats": ("", "holds both a SAELens (sae_weights.safetensors) and a sparsify (sae.safetensors) SAE: say "
                         "which (--format saelens or --format sparsify)"),
}  # fmt: skip
ACCEPTED = ("saelens-bfloat16", "saelens-float16", "saelens-float64-exact")


@pytest.fixture(scope="module")
def shards_dpath(tmp_path_factory):
    """Shards the fixtures' SAEs read (d_model 16, layer 1): an accepted checkpoint would become a run."""
    acts = np.random.default_rng(0).standard_normal((4, 1, 4, 16)).astype(np.float32)
    return write_shards(tmp_path_factory.mktemp("shards"), acts, layers=(1,), tag="hostile").dpath


def tree(dpath: pathlib.Path) -> dict:
    return {p.relative_to(dpath).as_posix(): p.read_bytes() for p in sorted(dpath.rglob("*")) if p.is_file()}


def refused_in_one_line(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err.strip()


def test_every_fixture_has_a_case():
    assert sorted(p.name for p in (HOSTILE / "refused").iterdir()) == sorted(REFUSED)
    assert sorted(p.name for p in (HOSTILE / "accepted").iterdir()) == sorted(ACCEPTED)


@pytest.mark.parametrize("name", list(REFUSED))
def test_hostile_checkpoints_are_refused_in_one_line_writing_nothing(name, shards_dpath, tmp_path, capsys):
    src = HOSTILE / "refused" / name
    before = tree(src)
    runs_root = tmp_path / "runs"
    err = refused_in_one_line(["import-checkpoint", str(src), "--runs-root", str(runs_root), "--shards",
                               str(shards_dpath)], capsys)  # fmt: skip
    fname, problem = REFUSED[name]
    assert err.startswith(f"saeflow import-checkpoint: error: {src / fname if fname else src}: "), err
    assert problem in err, err
    assert not runs_root.exists() and tree(src) == before


@pytest.mark.parametrize("name", ACCEPTED)
def test_other_float_dtypes_convert_exactly(name, shards_dpath, tmp_path, capsys):
    src = HOSTILE / "accepted" / name
    argv = ["import-checkpoint", str(src), "--runs-root", str(tmp_path / "runs"), "--shards", str(shards_dpath)]
    assert cli.main(argv) == 0
    model = sae.load_sae(pathlib.Path(capsys.readouterr().out.strip()) / "checkpoint" / "sae.pt")
    stored = safetensors.torch.load_file(src / "sae_weights.safetensors")
    assert stored["W_enc"].dtype == {"saelens-bfloat16": torch.bfloat16, "saelens-float16": torch.float16,
                                     "saelens-float64-exact": torch.float64}[name]  # fmt: skip
    assert torch.equal(model.W_enc.detach().double(), stored["W_enc"].double())
    assert torch.equal(model.W_dec.detach().double(), stored["W_dec"].double())
    if name == "saelens-float64-exact":  # the same values as SAELens's own float32 file: SAELens's outputs
        with np.load(src / "outputs.npz") as want, torch.no_grad():
            x_hat, f_bs = model(torch.from_numpy(want["x"]))
            np.testing.assert_allclose(f_bs.numpy(), want["codes"], rtol=1e-5, atol=1e-6)


def test_hook_names_are_checked_against_the_formats_own_names():
    for fmt, name in (("saelens", "blocks.3.hook_resid_post"), ("saelens", "blocks.0.attn.hook_z"),
                      ("sparsify", "layers.3"), ("sparsify", "h.3.mlp"), ("sparsify", "layers.3/seed0")):
        assert hooknames.well_formed(fmt, name), name
    for fmt in ("saelens", "sparsify"):
        for name in ("../x", "/etc/passwd", "blocks.1 hook", "a..b", "blocks.1.\n", "x" * 201, 3, "blocks.é"):
            assert not hooknames.well_formed(fmt, name), name


# ---------------------------------------------------------------------------------------------------------------
# Big and special files, in a fresh process: refused in one line within the memory bound, nothing written
# ---------------------------------------------------------------------------------------------------------------

# over the peak of importing the 4 KB SAELens fixture (the process's baseline): the caps' worth (cfg.json and header
# at most 1 MiB each, parsed) and noise
SLACK = 64 << 20
BIG_D_SAE = 1 << 25  # W_enc (16, 2^25) in float64: 4 GiB


def write_safetensors_header(fpath: pathlib.Path, header: dict, size: int | None = None) -> None:
    """A safetensors file of `header` whose data is a hole (sparse): `size` bytes in all (default: what it declares)."""
    raw = json.dumps(header).encode()
    with open(fpath, "wb") as fd:
        fd.write(struct.pack("<Q", len(raw)) + raw)
        end = max((d["data_offsets"][1] for n, d in header.items() if n != "__metadata__"), default=0)
        fd.truncate(size if size is not None else 8 + len(raw) + end)


def standard_header(d_sae: int, dtype: str, itemsize: int, w_dec_rows: int | None = None) -> dict:
    shapes = {"W_dec": [w_dec_rows or d_sae, 16], "W_enc": [16, d_sae], "b_dec": [16], "b_enc": [d_sae]}
    header, end = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [end, end + n]}
        end += n
    return header


def big_float64_mismatched(src: pathlib.Path) -> str:
    write_safetensors_header(src / "sae_weights.safetensors", standard_header(BIG_D_SAE, "F64", 8))
    return "sae_weights.safetensors: tensor 'W_dec' has shape [33554432, 16], but cfg.json (d_in=16, d_sae=32"


def big_float64_inconsistent(src: pathlib.Path) -> str:
    """cfg.json agrees with W_enc (4 GiB), W_dec has a row too many: refused from the header, nothing read."""
    (src / "cfg.json").write_text(json.dumps({**json.loads((src / "cfg.json").read_text()), "d_sae": BIG_D_SAE}))
    write_safetensors_header(src / "sae_weights.safetensors", standard_header(BIG_D_SAE, "F64", 8, BIG_D_SAE + 1))
    return "tensor 'W_dec' has shape [33554433, 16]"


def huge_header(src: pathlib.Path) -> str:
    """A 99 MB header (1.3M tensors' worth), refused by its length: the rest is a hole."""
    fpath = src / "sae_weights.safetensors"
    with open(fpath, "wb") as fd:
        fd.write(struct.pack("<Q", 99_000_000) + b'{"t0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ')
        fd.truncate(8 + 99_000_000 + 4 * 1_300_000)
    return "sae_weights.safetensors: safetensors header of 94.4 MiB, more than the 1.0 MiB"


def huge_cfg(src: pathlib.Path) -> str:
    with open(src / "cfg.json", "r+b") as fd:
        fd.truncate(1 << 30)
    return "cfg.json: 1.0 GiB, more than the 1.0 MiB a cfg.json may be"


def cfg_is_dev_zero(src: pathlib.Path) -> str:
    (src / "cfg.json").unlink()
    (src / "cfg.json").symlink_to("/dev/zero")
    return "cfg.json: a character device, not a regular file"


def cfg_is_fifo(src: pathlib.Path) -> str:
    (src / "cfg.json").unlink()
    os.mkfifo(src / "cfg.json")
    return "cfg.json: a FIFO, not a regular file"


def weights_are_fifo(src: pathlib.Path) -> str:
    (src / "sae_weights.safetensors").unlink()
    os.mkfifo(src / "sae_weights.safetensors")
    return "sae_weights.safetensors: a FIFO, not a regular file"


def weights_are_dev_zero(src: pathlib.Path) -> str:
    (src / "sae_weights.safetensors").unlink()
    (src / "sae_weights.safetensors").symlink_to("/dev/zero")
    return "sae_weights.safetensors: a character device, not a regular file"


def header_longer_than_file(src: pathlib.Path) -> str:
    (src / "sae_weights.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    return "sae_weights.safetensors: not a safetensors file (a header of 1099511627776 bytes in 10 bytes)"


BIG = {f.__name__: f for f in (big_float64_mismatched, big_float64_inconsistent, huge_header, huge_cfg,
                               cfg_is_dev_zero, cfg_is_fifo, weights_are_fifo, weights_are_dev_zero,
                               header_longer_than_file)}  # fmt: skip


def import_argv(src: pathlib.Path, runs_root: pathlib.Path, shards: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "saeflow", "import-checkpoint", str(src), "--runs-root", str(runs_root),
            "--shards", str(shards)]  # fmt: skip


@pytest.fixture(scope="module")
def baseline_bytes(shards_dpath, tmp_path_factory):
    """Peak RSS of importing SAELens's 4 KB standard fixture: the process's own footprint."""
    tmp = tmp_path_factory.mktemp("baseline")
    rc, _, stderr, peak = run_measured(import_argv(STANDARD, tmp / "runs", shards_dpath), tmp)
    assert rc == 0, stderr
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BIG))
def test_big_and_special_files_are_refused_within_the_memory_bound(name, shards_dpath, baseline_bytes, tmp_path):
    src = shutil.copytree(STANDARD, tmp_path / "src", ignore=shutil.ignore_patterns("outputs.npz"))
    problem = BIG[name](src)
    before = sorted(os.listdir(src))
    rc, stdout, stderr, peak = run_measured(import_argv(src, tmp_path / "runs", shards_dpath), tmp_path)
    assert rc == 1 and stdout == "" and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith(f"saeflow import-checkpoint: error: {src}/") and problem in stderr, stderr
    assert not (tmp_path / "runs").exists() and sorted(os.listdir(src)) == before
    assert peak < baseline_bytes + SLACK, f"{name}: {(peak - baseline_bytes) / 2**20:.0f} MiB over the baseline"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_big_legitimate_sae_imports_within_the_stated_bound(dtype, shards_dpath, baseline_bytes, tmp_path):
    """docs/interop.md's bound: peak <= baseline + 64 MiB + 4 x the SAE's float32 bytes (here 2^20 latents: 132 MiB)."""
    src = tmp_path / "src"
    src.mkdir()
    d_sae = 1 << 20
    (src / "cfg.json").write_text(json.dumps({**json.loads((STANDARD / "cfg.json").read_text()), "d_sae": d_sae}))
    tensors = {"W_enc": torch.zeros(16, d_sae, dtype=dtype), "W_dec": torch.zeros(d_sae, 16, dtype=dtype),
               "b_enc": torch.zeros(d_sae, dtype=dtype), "b_dec": torch.zeros(16, dtype=dtype)}  # fmt: skip
    safetensors.torch.save_file(tensors, src / "sae_weights.safetensors")
    float32_bytes = sum(t.numel() for t in tensors.values()) * 4
    del tensors
    rc, _, stderr, peak = run_measured(import_argv(src, tmp_path / "runs", shards_dpath), tmp_path)
    assert rc == 0, stderr
    over = peak - baseline_bytes
    assert over <= SLACK + 4 * float32_bytes, f"{over / 2**20:.0f} MiB over the baseline"
    print(f"{dtype}: {over / 2**20:.0f} MiB over the baseline for {float32_bytes / 2**20:.0f} MiB of float32 weights")
