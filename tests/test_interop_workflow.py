"""workflow/rules/interop.smk plans one job per `exports` entry (dry run; the jobs themselves are CLI-tested)."""

import pathlib
import subprocess
import sys

import pytest
import yaml

from hang import HANG_SEC

pytestmark = pytest.mark.slow  # every test here runs Snakemake or the CLI end to end

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dry_run_plans_one_job_per_export(tmp_path):
    (tmp_path / "Snakefile").write_text(
        "from snakemake.utils import validate\n\n\n"
        f'include: "{ROOT}/workflow/rules/config.smk"\n\n\n'
        f'validate(config, "{ROOT}/workflow/schemas/config.schema.yaml")\n\n\n'
        f'include: "{ROOT}/workflow/rules/common.smk"\n'
        f'include: "{ROOT}/workflow/rules/interop.smk"\n\n\n'
        "rule all:\n    input:\n        [PLAN.export_marker(name) for name in PLAN.cfg.exports],\n"
    )
    spec = {"model": {"name": "m"}, "prompts": {"path": "p.jsonl"}, "layers": [0]}
    exports = {"a": {**spec, "format": "lmprobe"}, "b": {**spec, "format": "zarr", "out": "elsewhere/b"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"activations": {}, "exports": exports}))
    cmd = [sys.executable, "-m", "snakemake", "--configfile", "config.yaml", "-n", "--cores", "1", "-p"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_SEC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "export_a" in out and "export_b" in out
    assert "results/exports/a/index/train-00000-of-00001.parquet" in out and "elsewhere/b/manifest.json" in out
    assert "saeflow export .snakemake/saeflow/exports/b.json --export b --out" in out
