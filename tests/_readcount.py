"""Counts the bytes a process reads with os.pread / os.preadv from files under one directory (tests only).

In the test process: `with ReadCounter(dpath) as counter: ...; counter.n_bytes`. In subprocesses (Snakemake jobs):
put tests/readcount/ on PYTHONPATH and set SAEFLOW_TEST_COUNT_READS=<dpath>:<out dpath>; every process that read
from <dpath> writes <out dpath>/<pid>.json ({"n_bytes", "argv"}) when it exits. It counts the system calls, not the
reader's own bookkeeping, so a loader that read the data twice could not hide it.
"""

import atexit
import json
import os
import pathlib
import sys
import threading


class ReadCounter:
    def __init__(self, dpath):
        self.prefix = os.path.realpath(dpath) + os.sep
        self.n_bytes = 0
        self._lock = threading.Lock()
        self._real = {}

    def _counts(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.prefix)
        except OSError:
            return False

    def _add(self, fd: int, n: int) -> None:
        if n > 0 and self._counts(fd):
            with self._lock:
                self.n_bytes += n

    def __enter__(self) -> "ReadCounter":
        self._real = {"pread": os.pread, "preadv": os.preadv}

        def pread(fd, n, offset):
            data = self._real["pread"](fd, n, offset)
            self._add(fd, len(data))
            return data

        def preadv(fd, buffers, offset, *flags):
            n = self._real["preadv"](fd, buffers, offset, *flags)
            self._add(fd, n)
            return n

        os.pread, os.preadv = pread, preadv
        return self

    def __exit__(self, *exc) -> None:
        os.pread, os.preadv = self._real["pread"], self._real["preadv"]


def install_from_env() -> None:
    spec = os.environ.get("SAEFLOW_TEST_COUNT_READS")
    if not spec:
        return
    dpath, out_dpath = spec.split(":", 1)
    counter = ReadCounter(dpath).__enter__()

    def report():
        if counter.n_bytes:
            out = pathlib.Path(out_dpath)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{os.getpid()}.json").write_text(json.dumps({"n_bytes": counter.n_bytes, "argv": sys.argv}))

    atexit.register(report)
