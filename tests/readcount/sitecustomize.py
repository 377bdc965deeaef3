"""Loaded at interpreter start-up when this directory is on PYTHONPATH: counts shard reads (tests/_readcount.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _readcount  # noqa: E402

_readcount.install_from_env()
