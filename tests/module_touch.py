"""`pytest --every-module`: fail the session when a saeflow module had none of its code run in the test process.

The fast tier (`make test-fast`: the tests not marked slow) runs with it, so a module that only the slow tests
reach, or none, is named at the end of the run. A module counts as run when one of its functions (methods,
lambdas, comprehensions, generators) was called while the tests ran; a module with no function at all (a package's
`__init__`, `__main__`) when it was imported or its body ran. Import-time execution of a module's body and class
bodies does not count for modules that have functions. Only this process is watched, not the CLI or Snakemake
subprocesses a test starts: sys.setprofile sees each call, and is removed once every module has been seen.
"""

import pathlib
import sys
import threading
import types

CO_NEWLOCALS = 0x0002  # a function's frame (def, lambda, comprehension, generator), not a module or class body

_state = {"files": {}, "todo": set()}  # every .py file -> has a function; those not seen yet


def package_files(package_dpath: pathlib.Path) -> dict[str, bool]:
    """Every .py file of the package -> whether it defines a function (then a call of one is what counts)."""
    out = {}
    for fpath in sorted(package_dpath.rglob("*.py")):
        code = compile(fpath.read_text(encoding="utf-8"), str(fpath), "exec")
        out[str(fpath)] = _has_function(code)
    return out


def _has_function(code: types.CodeType) -> bool:
    return any(
        isinstance(const, types.CodeType) and (const.co_flags & CO_NEWLOCALS or _has_function(const))
        for const in code.co_consts
    )


def _profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    fpath = code.co_filename
    if fpath in _state["todo"] and (code.co_flags & CO_NEWLOCALS or not _state["files"][fpath]):
        _state["todo"].discard(fpath)
        if not _state["todo"]:  # everything seen: stop paying for the hook (threads started later get none)
            sys.setprofile(None)
            threading.setprofile(None)


def pytest_addoption(parser):
    parser.addoption(
        "--every-module",
        action="store_true",
        help="fail when a saeflow module had none of its functions run in the test process (tests/module_touch.py)",
    )


def pytest_collection_finish(session):
    """Watch from the first test on: what importing the test modules runs does not count."""
    if not session.config.getoption("every_module"):
        return
    import saeflow

    package_dpath = pathlib.Path(saeflow.__file__).resolve().parent
    _state["package_dpath"] = package_dpath
    _state["files"] = package_files(package_dpath)
    _state["todo"] = set(_state["files"])
    threading.setprofile(_profile)
    sys.setprofile(_profile)


def untouched() -> list[str]:
    """The modules (relative paths) none of whose code ran; empty when the option is off. A module without
    functions counts once imported (a package's `__init__` runs when the tests are collected)."""
    imported = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    todo = [f for f in _state["todo"] if _state["files"][f] or f not in imported]
    return sorted(str(pathlib.Path(f).relative_to(_state["package_dpath"])) for f in todo)


def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("every_module"):
        return
    sys.setprofile(None)
    threading.setprofile(None)
    if untouched() and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not config.getoption("every_module"):
        return
    missing = untouched()
    n_files = len(_state["files"])
    if missing:
        terminalreporter.write_sep("=", f"{len(missing)} of {n_files} saeflow modules never ran", red=True)
        for rel in missing:
            terminalreporter.write_line(f"never ran: saeflow/{rel}")
    else:
        terminalreporter.write_sep("=", f"every saeflow module ran ({n_files} files)", green=True)
