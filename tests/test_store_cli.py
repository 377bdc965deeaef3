"""`saeflow validate` and `saeflow info` as a user runs them."""

import json
import os
import subprocess
import sys

from builders import make_md, write_all
from saeflow import cli
from saeflow.store import shards


def test_validate_and_info(shards_root, capsys):
    md = make_md()
    dpath = write_all(shards_root, md, aux=("labels.bin", "tokens.bin")).dpath
    assert cli.main(["validate", str(dpath)]) == 0
    assert cli.main(["validate", "--deep", str(dpath)]) == 0
    out = capsys.readouterr().out
    assert f"ok: {dpath} is a valid shard directory\n" in out and "(checksums verified)" in out

    assert cli.main(["info", "--json", str(dpath)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["hash"] == md.hash and info["metadata"] == md.to_dict()
    assert (info["n_shards"], info["ex_per_shard"], info["tokens_per_ex"]) == (3, 3, 5)
    assert info["n_bytes"] == 7 * 2 * 5 * 8 * 4 and info["side_files"] == ["labels.bin", "tokens.bin"]
    assert info["provenance"]["resumed_from_ex"] == 0 and "host" in info["provenance"]

    link = shards_root.parent / "train-shards"  # as a run's links/ holds it
    link.symlink_to(dpath)
    assert shards.validate(link).ok and shards.ShardDir(link).hash == md.hash
    assert cli.main(["info", str(dpath)]) == 0
    text = capsys.readouterr().out
    assert "layers       [3, 5]" in text and "3 x up to 3 examples" in text and "labels.bin, tokens.bin" in text


def test_entry_point_exit_codes(shards_root):
    """The installed `saeflow` script: exit 1 and a one-line error on stderr, no traceback."""
    missing = shards_root / ("0" * 64)
    saeflow = os.path.join(os.path.dirname(sys.executable), "saeflow")
    out = subprocess.run([saeflow, "info", str(missing)], capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("saeflow info: error: invalid shard directory") and str(missing) in out.stderr


def test_help_explains(capsys):
    for command in ("validate", "info"):
        try:
            cli.main([command, "--help"])
        except SystemExit as exit:
            assert exit.code == 0
    out = capsys.readouterr().out
    assert "--deep" in out and "Stray files" in out and "--json" in out
