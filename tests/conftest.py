"""Shared fixtures. Stage-specific fixtures live in the stage's own test modules."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def shards_root(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    return root
