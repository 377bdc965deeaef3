"""saev's `data` field (base64 of a pickled dataset config) decoded without running any of its code.

saev (OSU-NLP-Group) stores `base64.b64encode(pickle.dumps(dataset_config))` in its metadata: a frozen dataclass
from `saev.data.*` whose fields are strings, numbers, paths and other such dataclasses. `SaevDataUnpickler` is the
project's `BudgetUnpickler` (budgeted, pure Python, numpy-only allow-list) with three additions, all of them data,
never callables: a global from a `saev` module is a record token (NEWOBJ makes `{"__class__": name}`, BUILD fills
its fields, REDUCE with one plain argument is an enum member's value), `pathlib` path classes become their string,
and nothing else is resolved: `os.system`, `builtins.eval`, `subprocess...` are refused before anything is imported.

`decode` returns protocol 2.0's form of `data` (`dataclasses.asdict(cfg) | {"__class__": ...}`) as plain JSON.
"""

import base64
import binascii
import io
import math
import pickle
import posixpath
import re

from saeflow.errors import SaeflowError
from saeflow.interop.budget import Budget, fmt_bytes
from saeflow.interop.safe_unpickle import OPCODE_BYTES, BudgetUnpickler, _costed, _Dispatch

PATH_CLASSES = ("Path", "PosixPath", "PurePath", "PurePosixPath")
_SAEV_MODULE = re.compile(r"saev(\.[A-Za-z_][A-Za-z0-9_]*)*")
_SCALARS = (str, int, float, bool, type(None))


class _Token:
    """What a saev-data global resolves to: a name, never the class or function itself."""

    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name


class _Record(dict):
    """A dataclass instance as its fields plus `__class__` (protocol 2.0's form of `data`)."""


class SaevDataUnpickler(BudgetUnpickler):
    """`BudgetUnpickler` plus saev dataset-config records and paths; see the module docstring."""

    def find_class(self, module: str, name: str):
        if module == "pathlib" and name in PATH_CLASSES:
            return _Token("path", name)
        if _SAEV_MODULE.fullmatch(module) and name.isidentifier():
            return _Token("record", name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in saev's data pickle")

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack[-1]
        if not (isinstance(cls, _Token) and cls.kind == "record" and args == ()):
            raise pickle.UnpicklingError("NEWOBJ of anything but a saev dataclass is not allowed in saev's data")
        self.stack[-1] = _Record(__class__=cls.name)

    def load_reduce(self):
        func = self.stack[-2] if len(self.stack) > 1 else None
        if not isinstance(func, _Token):
            return BudgetUnpickler.load_reduce(self)
        args = self.stack.pop()
        if not isinstance(args, tuple):
            raise pickle.UnpicklingError(f"{func.name}(...) without an argument tuple")
        if func.kind == "path" and all(isinstance(a, str) for a in args):
            self.stack[-1] = posixpath.join(*args) if args else "."
        elif func.kind == "record" and len(args) == 1 and isinstance(args[0], _SCALARS):
            self.stack[-1] = args[0]  # an Enum member pickles as Enum(value): keep the value
        else:
            raise pickle.UnpicklingError(f"calling {func.name}{args!r:.60} is not allowed in saev's data")

    def load_build(self):
        inst = self.stack[-2] if len(self.stack) > 1 else None
        if not isinstance(inst, _Record):
            return BudgetUnpickler.load_build(self)
        state = self.stack.pop()
        if isinstance(state, tuple) and len(state) == 2:  # (dict or None, slots dict)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) and k != "__class__" for k in state):
            raise pickle.UnpicklingError(f"the state of {inst['__class__']} is not a dict of fields")
        inst.update(state)


SaevDataUnpickler.dispatch = _Dispatch(BudgetUnpickler.dispatch)
for _op, _load in ((pickle.NEWOBJ, SaevDataUnpickler.load_newobj), (pickle.REDUCE, SaevDataUnpickler.load_reduce),
                   (pickle.BUILD, SaevDataUnpickler.load_build)):
    SaevDataUnpickler.dispatch[_op[0]] = _costed(_load, OPCODE_BYTES)


def _plain(value, where: str):
    """`value` as plain JSON (tuples become lists), or a SaeflowError naming what cannot be."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SaeflowError(f"{where}: saev's data holds the non-finite number {value}; cannot express it as JSON")
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, where) for k, v in value.items()}
    raise SaeflowError(f"{where}: saev's data holds a {type(value).__name__}, which has no JSON form")


def decode(data_b64: str, limit_bytes: int, where: str) -> dict:
    """saev's `data` string as a plain JSON object with `__class__` (a dict pickle gets `"__class__": "dict"`)."""
    if len(data_b64) > limit_bytes // 4:
        raise SaeflowError(f"{where}: saev's data is {fmt_bytes(len(data_b64))} of base64, more than a quarter of "
                           "the memory budget; refusing")
    try:
        raw = base64.b64decode(data_b64.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise SaeflowError(f"{where}: saev's data is not base64 text") from None
    try:
        value = SaevDataUnpickler(io.BytesIO(raw), Budget(limit_bytes, where)).load()
    except SaeflowError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as err:
        raise SaeflowError(f"{where}: saev's data pickle is refused ({err}); nothing in it was run") from None
    if not isinstance(value, dict):
        raise SaeflowError(f"{where}: saev's data pickle holds a {type(value).__name__}, not a dataset config")
    obj = _plain(value, where)
    obj.setdefault("__class__", "dict")
    if not isinstance(obj["__class__"], str):
        raise SaeflowError(f"{where}: saev's data has a non-string __class__")
    return obj
