"""What is reproducible across platforms (saeflow.numerics) and how two results of one hash compare (saeflow compare).

Bitwise: with the default `portable` kernels, an extraction's bytes depend neither on the machine's AVX-512 support
(faked by capping oneDNN and ATen to AVX2) nor on the thread count. Across kernel choices (`native` against
`portable`), the bytes differ and `saeflow compare` finds them within its tolerance.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from builders import file_bytes, identity_sae, run_around_sae, vision_spec, write_shards
from hang import HANG_SEC
from saeflow import cli, numerics
from saeflow.store import provenance
from saeflow.store.shards import parts
from workflow_helpers import TEST_THREADS_ENV, env, write_config

PORTABLE_VARIANTS = {
    "as is": {},
    "ISA capped": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "default"},
    "1 thread": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
}
NATIVE_AVX2 = {numerics.ENV_VAR: "native", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def _extract(tmp_path, name: str, extra_env: dict):
    """`saeflow extract` of a tiny random ViT (patch convolution, GELU, layer norm) in its own process."""
    spec = vision_spec(layers=[-1])  # one layer: the CLI's directories are one per layer
    config_fpath = write_config(tmp_path, {"activations": {"vit": spec}, "saes": {}})
    inherited = {*numerics.PORTABLE_ENV, *TEST_THREADS_ENV}  # the conftest's pins and thread count: "as is" is as is
    clean = {k: v for k, v in env().items() if k not in inherited}
    cmd = [sys.executable, "-m", "saeflow", "extract", str(config_fpath), "--shards-root", str(tmp_path / name),
           "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, env={**clean, **extra_env}, capture_output=True, text=True, timeout=HANG_SEC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (dpath,) = (tmp_path / name).iterdir()
    return dpath


@pytest.mark.skipif(numerics.effective_mode({}) != "portable", reason="portable kernels need an x86-64 AVX2 CPU")
@pytest.mark.slow
def test_portable_bytes_ignore_the_instruction_set_and_thread_count_and_native_ones_compare_within_tolerance(
    tmp_path, capsys
):
    dpaths = {name: _extract(tmp_path, name.replace(" ", "-"), extra) for name, extra in PORTABLE_VARIANTS.items()}
    reference = file_bytes(dpaths["as is"])
    for name, dpath in dpaths.items():
        assert file_bytes(dpath) == reference, name
        platform = json.loads((dpath / "provenance.json").read_text())["platform"]
        assert platform["numerics"] == "portable" and platform["cpu_capability"] == "AVX2"
        assert platform["mkldnn_enabled"] is False
    native = _extract(tmp_path, "native-avx2", NATIVE_AVX2)
    assert native.name == dpaths["as is"].name  # one config, one name, whatever the kernels
    assert json.loads((native / "provenance.json").read_text())["platform"]["numerics"] == "native"
    assert cli.main(["compare", str(dpaths["as is"]), str(native)]) == 0
    out = capsys.readouterr().out
    assert "layer 2 " in out and out.rstrip().endswith("within tolerance")  # [-1] of 3


def test_a_bad_numerics_mode_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(numerics.ENV_VAR, "fast")
    assert cli.main(["validate", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "saeflow validate: error: SAEFLOW_NUMERICS='fast': not a numerics mode; choose one of portable, native\n"
    )


def test_apply_pins_the_kernels_only_in_portable_mode():
    environ = {numerics.ENV_VAR: "native"}
    numerics.apply(environ)
    assert environ == {numerics.ENV_VAR: "native"}
    environ = {"ATEN_CPU_CAPABILITY": "avx512"}  # a user's own choice would undo the pins: they win
    mode = numerics.apply(environ)
    assert environ == ({**numerics.PORTABLE_ENV} if mode == "portable" else {"ATEN_CPU_CAPABILITY": "avx512"})


def _pair(tmp_path, delta: float = 0.0, labels_b=None):
    rng = np.random.default_rng(0)
    x_nltd = rng.standard_normal((6, 1, 4, 8)).astype(np.float32)
    labels = rng.integers(0, 5, (6, 4)).astype(np.uint8)
    a = write_shards(tmp_path / "a", x_nltd, layers=(0,), aux={"labels.bin": labels})
    b = write_shards(tmp_path / "b", x_nltd * (1 + delta), layers=(0,),
                     aux={"labels.bin": labels if labels_b is None else labels_b})  # fmt: skip
    assert a.hash == b.hash
    return a.dpath, b.dpath


def test_compare_passes_within_tolerance_and_fails_beyond_it(tmp_path, capsys):
    a, b = _pair(tmp_path / "close", delta=1e-6)
    assert cli.main(["compare", str(a), str(b), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["tol"] == 1e-4
    (layer,) = [row for row in report["rows"] if row["name"] == "layer 0"]
    assert 0 < layer["rel"] < 2e-6 and layer["max_abs"] > 0
    a, b = _pair(tmp_path / "far", delta=1e-3)
    assert cli.main(["compare", str(a), str(b)]) == 1
    assert "ABOVE TOLERANCE" in capsys.readouterr().out
    assert cli.main(["compare", str(a), str(b), "--tol", "0.01"]) == 0
    capsys.readouterr()
    a, b = _pair(tmp_path / "labels", labels_b=np.zeros((6, 4), np.uint8))
    assert cli.main(["compare", str(a), str(b)]) == 1
    assert "labels.bin               DIFFERENT (integer side file)" in capsys.readouterr().out


def test_compare_refuses_two_different_configs_in_one_line(tmp_path, capsys):
    x_nltd = np.ones((2, 1, 3, 4), np.float32)
    a = write_shards(tmp_path / "a", x_nltd, layers=(0,), tag="a")
    b = write_shards(tmp_path / "b", x_nltd, layers=(0,), tag="b")
    assert cli.main(["compare", str(a.dpath), str(b.dpath)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"saeflow compare: error: {b.dpath}: its metadata") and err.count("\n") == 1
    assert cli.main(["compare", str(tmp_path), str(b.dpath)]) == 1
    assert "neither a shard directory (metadata.json) nor a run" in capsys.readouterr().err


def test_compare_runs_tensor_by_tensor(tmp_path, capsys):
    sd = write_shards(tmp_path / "shards", np.ones((2, 1, 3, 4), np.float32), layers=(0,))
    a = run_around_sae(tmp_path / "a", sd, identity_sae(4), layer=0)
    b = run_around_sae(tmp_path / "b", sd, identity_sae(4), layer=0)
    assert cli.main(["compare", str(a.root), str(b.root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run: ") and "W_dec" in out and "relative 0" in out


def test_a_seal_of_parts_from_two_platforms_warns_and_records_it(tmp_path, monkeypatch, caplog):
    from saeflow.extraction import extract
    from saeflow.extraction.specs import ActivationSpec

    spec = ActivationSpec.from_dict(vision_spec(batch_size=2))
    extract.extract(spec, tmp_path, progress=False, part=(0, 2))
    real_platform = provenance.platform
    monkeypatch.setattr(provenance, "platform", lambda: {**real_platform(), "gpu": "NVIDIA H100 80GB HBM3"})
    extract.extract(spec, tmp_path, progress=False, part=(1, 2))
    monkeypatch.setattr(provenance, "platform", real_platform)
    with caplog.at_level("WARNING", logger=parts.__name__):
        sealed = extract.seal(spec, tmp_path, 2)
    assert "its parts were computed on 2 platforms" in caplog.text and "NVIDIA H100" in caplog.text
    prov = json.loads((sealed.dpath / "provenance.json").read_text())
    assert prov["mixed_platforms"] is True
    assert [p["platform"].get("gpu") for p in prov["parts"]] == [None, "NVIDIA H100 80GB HBM3"]
