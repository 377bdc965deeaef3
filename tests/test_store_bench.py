"""The writer benchmark runs end to end at a tiny size and cleans up after itself (no timing asserted)."""

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench_writer.py"


def test_bench_writer_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_writer", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--gib", "0.01", "--shard-mib", "4", "--repeats", "1", "--batch-ex", "4", "--dir", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "plain sequential write+fsync:" in out and "ShardWriter" in out and "ratio = " in out
    assert list(tmp_path.iterdir()) == []
