"""An unpickler for untrusted activation shards that runs no foreign code and holds a memory budget.

`BudgetUnpickler` is the pure-Python `pickle._Unpickler` with its opcode table rebuilt:

- every opcode is charged a fixed cost (`OPCODE_BYTES`, more for memo entries and marks), so containers, stack
  and memo growth from memo references (a 3-byte opcode that appends an 8-byte reference) stay within budget;
- every `read(n)` (string, bytes, bytearray, long and frame payloads) is charged before it is read, so a declared
  length over the budget is refused before anything is allocated; str decoding charges the widest result first;
- opcodes activation shards never use (sets, INST/OBJ/NEWOBJ, extensions, persistent ids, out-of-band buffers)
  are refused;
- globals resolve to `_Global` tokens, never to the real callables. REDUCE and BUILD accept only those tokens and
  numpy arrays / dtypes, and each allowed call (`_reconstruct`, `ndarray`, `dtype`, `scalar`, `_frombuffer`,
  `_codecs.encode`) checks its arguments (plain numeric dtypes only, declared shape against the budget, raw data
  length against the shape) and charges what it allocates before calling numpy.

The decompressed stream itself is capped at the budget by `BoundedStream` (streamed, so a gzip bomb stops at the
cap). Anything else that goes wrong while unpickling becomes a one-line `SaeflowError` naming the file.
"""

import codecs
import pickle
import re

import numpy as np
from numpy._core import multiarray, numeric

from saeflow.errors import SaeflowError
from saeflow.interop.budget import Budget, check_alloc, check_shape, fmt_bytes

OPCODE_BYTES = 64  # covers the object or reference one opcode pushes (an int, a tuple slot, a dict entry)
MEMO_BYTES = 128  # a memo dict entry
MARK_BYTES = 128  # a new stack list on the metastack
GLOBALS = {
    **{(m, name): name for m in ("numpy.core.multiarray", "numpy._core.multiarray") for name in ("_reconstruct",
                                                                                                  "scalar")},
    **{(m, "_frombuffer"): "_frombuffer" for m in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): "ndarray",
    ("numpy", "dtype"): "dtype",
    ("_codecs", "encode"): "encode",
}
DTYPE_KINDS = "biufcSUMm"  # plain numeric, string and datetime dtypes: no objects, no structs, no voids
_BAD_DTYPE_FLAGS = 1 | 2 | 4 | 16 | 32 | 64  # refcount/list-pickle/pointer/pyapi/getitem/setitem: object-like
_OP = pickle  # opcode constants
REFUSED_OPCODES = {op[0] for op in (_OP.EMPTY_SET, _OP.ADDITEMS, _OP.FROZENSET, _OP.INST, _OP.OBJ, _OP.NEWOBJ,
                                    _OP.NEWOBJ_EX, _OP.EXT1, _OP.EXT2, _OP.EXT4, _OP.PERSID, _OP.BINPERSID,
                                    _OP.NEXT_BUFFER, _OP.READONLY_BUFFER)}
_WIDE_UTF8 = re.compile(rb"[\xf0-\xff]")  # a 4-byte UTF-8 sequence: the str stores 4 bytes per character
_MID_UTF8 = re.compile(rb"[\xc4-\xff]")  # a character above U+00FF: 2 bytes per character


class _Global:
    """What `find_class` returns instead of the real callable: only `BudgetUnpickler` can call it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<allowed global {self.name}>"


class BoundedStream:
    """A file-like view of `inner` (a GzipFile or raw file) that refuses to yield more than `limit_bytes`."""

    def __init__(self, inner, limit_bytes: int, where: str):
        self.inner, self.left, self.limit_bytes, self.where = inner, limit_bytes, limit_bytes, where

    def _took(self, data: bytes) -> bytes:
        self.left -= len(data)
        if self.left < 0:
            raise SaeflowError(f"{self.where}: decompresses to more than the memory budget of "
                               f"{fmt_bytes(self.limit_bytes)}; refusing")
        return data

    def read(self, n: int = -1) -> bytes:
        return self._took(self.inner.read(self.left + 1 if n is None or n < 0 else min(n, self.left + 1)))

    def readline(self, n: int = -1) -> bytes:
        """One line of at most a quarter of the budget (protocol 0 text fields; readline buffers it twice)."""
        cap = max(1, self.limit_bytes // 4)
        line = self._took(self.inner.readline(min(cap, self.left + 1) if n is None or n < 0 else min(n, cap)))
        if len(line) >= cap and not line.endswith(b"\n"):
            raise SaeflowError(f"{self.where}: a pickle text line longer than {fmt_bytes(cap)} (a quarter of the "
                               "memory budget); refusing")
        return line


def _costed(load, cost: int):
    def load_charged(self):
        self.budget.charge(cost, "unpickling")
        load(self)

    return load_charged


class _Dispatch(dict):
    def __missing__(self, op):
        raise pickle.UnpicklingError(f"opcode {bytes([op])!r} is not allowed in an activation shard")


class BudgetUnpickler(pickle._Unpickler):
    """Unpickles numpy arrays and plain containers within `budget`; see the module docstring."""

    def __init__(self, stream, budget: Budget):
        super().__init__(stream)
        self.budget = budget

    def find_class(self, module: str, name: str):
        if (module, name) in GLOBALS:
            return _Global(GLOBALS[(module, name)])
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in an activation shard")

    def load(self):
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)
        self.readline = self._readline
        self.read = self._read
        self.metastack, self.stack, self.proto = [], [], 0
        self.append = self.stack.append
        try:
            while True:
                key = self.read(1)
                if not key:
                    raise EOFError("the pickle ends before its STOP opcode")
                self.dispatch[key[0]](self)
        except pickle._Stop as stop:
            return stop.value

    def _read(self, n: int) -> bytes:
        self.budget.charge(n, f"a {fmt_bytes(n)} pickle field")
        data = self._unframer.read(n)
        if len(data) < n:
            raise EOFError(f"the pickle ends inside a {n}-byte field")
        return data

    def _readline(self) -> bytes:
        line = self._unframer.readline()
        self.budget.charge(len(line), "a pickle text field")
        return line

    def _decoded(self, data: bytes) -> str:
        """UTF-8 `data` as str, charging the widest the str can be before decoding (the raw bytes are then freed)."""
        width = 4 if _WIDE_UTF8.search(data) else 2 if _MID_UTF8.search(data) else 1
        self.budget.charge(width * len(data), "a pickled string")
        text = str(data, "utf-8", "surrogatepass")
        self.budget.release(len(data) * (width + 1) - len(text) * width)
        return text

    def load_frame(self):
        (frame_bytes,) = _unpack_q(self._unframer.read(8))
        self.budget.charge(frame_bytes, f"a {fmt_bytes(frame_bytes)} pickle frame")
        self._unframer.load_frame(frame_bytes)

    def load_binunicode(self):
        self.append(self._decoded(self.read(int.from_bytes(self.read(4), "little"))))

    def load_binunicode8(self):
        self.append(self._decoded(self.read(int.from_bytes(self.read(8), "little"))))

    def load_short_binunicode(self):
        self.append(self._decoded(self.read(self.read(1)[0])))

    def load_unicode(self):
        line = self.readline()[:-1]
        self.budget.charge(4 * len(line), "a pickled string")
        self.append(str(line, "raw-unicode-escape"))

    def load_bytearray8(self):
        self.append(bytearray(self.read(int.from_bytes(self.read(8), "little"))))

    def load_long4(self):
        n_bytes = int.from_bytes(self.read(4), "little", signed=True)
        if n_bytes < 0:
            raise pickle.UnpicklingError("LONG4 with a negative byte count")
        data = self.read(n_bytes)
        self.budget.charge(n_bytes + 32, "a pickled int")
        self.append(pickle.decode_long(data))

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not isinstance(func, _Global) or not isinstance(args, tuple):
            raise pickle.UnpicklingError(f"REDUCE of {type(func).__name__} is not allowed in an activation shard")
        self.stack[-1] = _CALLS[func.name](self.budget, *args)

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is np.ndarray:
            _set_array_state(self.budget, inst, state)
        elif isinstance(inst, np.dtype):
            _set_dtype_state(inst, state)
        else:
            raise pickle.UnpicklingError(f"BUILD of {type(inst).__name__} is not allowed in an activation shard")


def _unpack_q(data: bytes) -> tuple[int]:
    return (int.from_bytes(data, "little"),)


def _make_dispatch() -> dict:
    own = {_OP.FRAME: "load_frame", _OP.BINUNICODE: "load_binunicode", _OP.BINUNICODE8: "load_binunicode8",
           _OP.SHORT_BINUNICODE: "load_short_binunicode", _OP.UNICODE: "load_unicode",
           _OP.BYTEARRAY8: "load_bytearray8", _OP.LONG4: "load_long4", _OP.REDUCE: "load_reduce",
           _OP.BUILD: "load_build"}
    table = _Dispatch()
    for op, load in pickle._Unpickler.dispatch.items():
        if op in REFUSED_OPCODES:
            continue
        code = bytes([op])
        load = getattr(BudgetUnpickler, own[code]) if code in own else load
        cost = MEMO_BYTES if code in (_OP.PUT, _OP.BINPUT, _OP.LONG_BINPUT, _OP.MEMOIZE) else OPCODE_BYTES
        table[op] = _costed(load, MARK_BYTES if code == _OP.MARK else cost)
    return table


BudgetUnpickler.dispatch = _make_dispatch()


# ---------------------------------------------------------------------------------------------------------------
# The allowed calls, each checked and charged before numpy allocates
# ---------------------------------------------------------------------------------------------------------------


def _plain_dtype(dtype, what: str) -> np.dtype:
    if not isinstance(dtype, np.dtype):
        raise pickle.UnpicklingError(f"{what}: dtype {type(dtype).__name__} is not a numpy dtype")
    if dtype.hasobject or dtype.kind not in DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise SaeflowError(f"{what} of dtype {dtype} (object, struct or void) is not allowed in an activation shard")
    return dtype


def _call_dtype(budget: Budget, spec=None, align=False, copy=None, *rest) -> np.dtype:
    if rest or not isinstance(spec, str) or len(spec) > 16 or align is not False or copy is not True:
        raise pickle.UnpicklingError(f"dtype{(spec, align, copy, *rest)!r}: only numpy's own dtype pickles are read")
    budget.charge(OPCODE_BYTES * 4, "a dtype")
    return _plain_dtype(np.dtype(spec, False, True), "an array")  # a copy: BUILD must not touch numpy's own


def _set_dtype_state(dtype: np.dtype, state) -> None:
    if (not isinstance(state, tuple) or len(state) not in (8, 9) or state[2:5] != (None, None, None)
            or type(state[7]) is not int or state[7] & _BAD_DTYPE_FLAGS):
        raise SaeflowError(f"dtype state {state!r:.80} is not a plain numeric dtype; refusing")
    dtype.__setstate__(state)
    _plain_dtype(dtype, "an array")


def _call_reconstruct(budget: Budget, cls=None, shape=None, typecode=None, *rest) -> np.ndarray:
    if rest or not isinstance(cls, _Global) or cls.name != "ndarray" or not isinstance(typecode, bytes):
        raise pickle.UnpicklingError("_reconstruct: only plain numpy.ndarray is reconstructed")
    dtype = _plain_dtype(np.dtype(typecode.decode("ascii")), "an array")
    budget.charge(check_alloc(shape, dtype.itemsize, budget.limit_bytes, budget.where, "an array") + 128, "an array")
    return multiarray._reconstruct(np.ndarray, shape, typecode)


def _call_ndarray(budget: Budget, shape=None, dtype=None, *rest) -> np.ndarray:
    dtype = np.dtype(np.float64) if dtype is None else dtype
    if rest:
        raise pickle.UnpicklingError("ndarray(...): only ndarray(shape, dtype) is allowed")
    _plain_dtype(dtype, "an array")
    budget.charge(check_alloc(shape, dtype.itemsize, budget.limit_bytes, budget.where, "an array") + 128, "an array")
    return np.ndarray(shape, dtype)


def _set_array_state(budget: Budget, arr: np.ndarray, state) -> None:
    if not isinstance(state, tuple) or len(state) != 5:
        raise pickle.UnpicklingError("ndarray state must be (version, shape, dtype, fortran, data)")
    _, shape, dtype, fortran, data = state
    _plain_dtype(dtype, "an array")
    n = check_alloc(check_shape(shape, budget.where, "an array"), dtype.itemsize, budget.limit_bytes, budget.where,
                    "an array")
    if not isinstance(data, (bytes, bytearray)) or len(data) != n or type(fortran) is not bool:
        raise SaeflowError(f"{budget.where}: an array of shape {shape} and dtype {dtype} comes with "
                           f"{len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__} "
                           f"bytes of data instead of {n}; refusing")
    budget.charge(n, "an array")  # __setstate__ copies the raw bytes
    arr.__setstate__(state)


def _call_frombuffer(budget: Budget, buf=None, dtype=None, shape=None, order=None, *rest) -> np.ndarray:
    if rest or not isinstance(buf, (bytes, bytearray)) or order not in ("C", "F"):
        raise pickle.UnpicklingError("_frombuffer: only (bytes, dtype, shape, order) is allowed")
    _plain_dtype(dtype, "an array")
    n = check_alloc(shape, dtype.itemsize, budget.limit_bytes, budget.where, "an array")
    if len(buf) != n:
        raise SaeflowError(f"{budget.where}: an array of shape {shape} and dtype {dtype} comes with {len(buf)} "
                           f"bytes of data instead of {n}; refusing")
    budget.charge(128, "an array")  # a view of buf: no copy
    return numeric._frombuffer(buf, dtype, shape, order)


def _call_scalar(budget: Budget, dtype=None, data=None, *rest):
    _plain_dtype(dtype, "a scalar")
    if rest or not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise pickle.UnpicklingError(f"scalar: {dtype} needs {dtype.itemsize} bytes of data")
    budget.charge(64 + dtype.itemsize, "a scalar")
    return multiarray.scalar(dtype, data)


def _call_encode(budget: Budget, text=None, encoding="utf-8", *rest) -> bytes:
    if rest or not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode: only (str, 'latin1'), as pickle protocol 2 writes bytes")
    budget.charge(len(text) + 64, "bytes from _codecs.encode")
    return codecs.encode(text, "latin1")


_CALLS = {"dtype": _call_dtype, "_reconstruct": _call_reconstruct, "ndarray": _call_ndarray,
          "_frombuffer": _call_frombuffer, "scalar": _call_scalar, "encode": _call_encode}
