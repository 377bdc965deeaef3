"""Split extraction: part jobs of whole shards + one seal give the same bytes as one job, and each piece resumes."""

import json

import pytest

from builders import file_bytes, vision_spec
from saeflow.errors import SaeflowError
from saeflow.extraction import adapters, extract
from saeflow.extraction.specs import ActivationSpec
from saeflow.store.shards import parts

SPEC = vision_spec(batch_size=2)  # 10 examples, 3 per shard: 4 shards, the last one short


def _typed(**overrides):
    return ActivationSpec.from_dict({**SPEC, **overrides})


def _split(root, n_parts):
    for part_idx in range(n_parts):
        extract.extract(_typed(), root, progress=False, part=(part_idx, n_parts))
    return extract.seal(_typed(), root, n_parts)


def test_part_ranges_are_contiguous_whole_shards():
    assert parts.part_ranges(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert parts.part_ranges(2, 5) == [(0, 1), (1, 2)]  # at most one part per shard
    assert parts.part_ranges(7, 1) == [(0, 7)]


@pytest.fixture(scope="module")
def one_job(tmp_path_factory):
    return extract.extract(_typed(), tmp_path_factory.mktemp("one"), progress=False).dpath


@pytest.mark.parametrize("n_parts", [2, 4])
def test_any_number_of_parts_gives_the_same_bytes(tmp_path, one_job, n_parts):
    sealed = _split(tmp_path, n_parts)
    assert not sealed.reused and sealed.dpath.name == one_job.name
    assert file_bytes(sealed.dpath) == file_bytes(one_job)
    prov = json.loads((sealed.dpath / "provenance.json").read_text())
    assert [p["resumed_from_ex"] for p in prov["parts"]] == [0] * n_parts
    assert not (tmp_path / f".{one_job.name}.parts").exists()  # the parts area is gone once published
    assert extract.seal(_typed(), tmp_path, n_parts).reused  # sealing again: nothing to do


def test_a_crashed_part_resumes_that_part_only(tmp_path, one_job, monkeypatch):
    extract.extract(_typed(), tmp_path, progress=False, part=(0, 2))
    done_0 = tmp_path / f".{one_job.name}.parts" / "part-0-of-2" / "part.json"
    mtime_0 = done_0.stat().st_mtime_ns
    real_run, calls = adapters.Adapter.run_points, []

    def crashing_run(self, batch, points):
        calls.append(1)
        if len(calls) == 3:  # part 1 of 2 is shards 2 (examples 6..8, 2 batches) and 3 (example 9): dies in shard 3
            raise RuntimeError("killed")
        return real_run(self, batch, points)

    monkeypatch.setattr(adapters.Adapter, "run_points", crashing_run)
    with pytest.raises(RuntimeError, match="killed"):
        extract.extract(_typed(), tmp_path, progress=False, part=(1, 2))
    monkeypatch.setattr(adapters.Adapter, "run_points", real_run)
    with pytest.raises(SaeflowError, match=r"part-1-of-2 is not a finished part"):
        extract.seal(_typed(), tmp_path, 2)
    assert not (tmp_path / one_job.name).exists()
    resumed = extract.extract(_typed(), tmp_path, progress=False, part=(1, 2))
    assert resumed.resumed_from == 9  # shard 2 was kept; only shard 3 was computed again
    assert extract.extract(_typed(), tmp_path, progress=False, part=(0, 2)).reused  # part 0 is left alone
    assert done_0.stat().st_mtime_ns == mtime_0
    sealed = extract.seal(_typed(), tmp_path, 2)
    assert file_bytes(sealed.dpath) == file_bytes(one_job)
    prov = json.loads((sealed.dpath / "provenance.json").read_text())
    assert [p["resumed_from_ex"] for p in prov["parts"]] == [0, 3]


def test_the_seal_refuses_a_corrupt_part_and_publishes_nothing(tmp_path, one_job):
    for part_idx in range(2):
        extract.extract(_typed(), tmp_path, progress=False, part=(part_idx, 2))
    shard = tmp_path / f".{one_job.name}.parts" / "part-1-of-2" / "acts000003.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(SaeflowError, match=r"acts000003.bin: missing, or its size or sha256 differs"):
        extract.seal(_typed(), tmp_path, 2)
    assert not (tmp_path / one_job.name).exists()


def test_a_seal_killed_while_linking_resumes(tmp_path, one_job, monkeypatch):
    for part_idx in range(4):
        extract.extract(_typed(), tmp_path, progress=False, part=(part_idx, 4))
    real_move, calls = parts._move_shard, []

    def dying_move(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real_move(*args)

    monkeypatch.setattr(parts, "_move_shard", dying_move)
    with pytest.raises(RuntimeError, match="killed"):
        extract.seal(_typed(), tmp_path, 4)
    monkeypatch.setattr(parts, "_move_shard", real_move)
    sealed = extract.seal(_typed(), tmp_path, 4)
    assert file_bytes(sealed.dpath) == file_bytes(one_job)
    assert json.loads((sealed.dpath / "provenance.json").read_text())["resumed_from_ex"] == 6


def test_a_part_that_does_not_exist_is_one_clear_error(tmp_path):
    with pytest.raises(SaeflowError, match=r"part 4/5 does not exist: .* has 4 shards"):
        extract.extract(_typed(), tmp_path, progress=False, part=(4, 5))
