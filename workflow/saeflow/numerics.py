"""Which CPU float kernels torch uses, and the platform a result was computed on (recorded in provenance.json).

torch picks its CPU kernels by the instruction set it finds: ATen's own vectorized kernels (AVX-512 or AVX2:
softmax, layer norm, reductions), oneDNN's JIT kernels (convolutions, GELU; blocked by ISA and cache size) and MKL's
GEMM code paths. Each rounds differently, so one config gives other float bytes on another CPU, while its shard
directory keeps its name. `SAEFLOW_NUMERICS` chooses:

- `portable` (the default on x86-64 with AVX2): ATen's kernels pinned to AVX2 (`ATEN_CPU_CAPABILITY`), oneDNN kept
  out (ATen's own convolution and GELU take over), MKL in its AVX2 conditional-numerical-reproducibility branch,
  strict mode (`MKL_CBWR=AVX2,STRICT`). The bytes then no longer depend on the machine's AVX-512 support or its
  thread count. Intel documents MKL's AVX2 branch as reproducible on Intel CPUs only; an AMD CPU runs MKL's own
  branch, so across vendors results agree within float tolerance, not bitwise (docs/contracts.md).
- `native`: torch's own choice: the fastest kernels of this machine, bitwise reproducible on this platform only.

`apply()` must run before torch dispatches its first CPU kernel (the CLI calls it first thing); `configure_torch()`
turns oneDNN off once torch is imported. `platform()` records what was actually in force, not what was asked for.
"""

import logging
import os
import platform as _platform
import re
import sys

from saeflow.errors import SaeflowError

logger = logging.getLogger(__name__)

ENV_VAR = "SAEFLOW_NUMERICS"
MODES = ("portable", "native")
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
_warned: list[str] = []  # warn once per process


def requested_mode(environ=None) -> str:
    """The mode `SAEFLOW_NUMERICS` asks for (default `portable`); a one-line error for any other value."""
    mode = (os.environ if environ is None else environ).get(ENV_VAR, "portable").strip().lower() or "portable"
    if mode not in MODES:
        raise SaeflowError(f"{ENV_VAR}={mode!r}: not a numerics mode; choose one of {', '.join(MODES)}")
    return mode


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fd:
            for line in fd:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _portable_possible() -> bool:
    """The pins name x86-64 AVX2 kernels: elsewhere (ARM, old CPUs) torch's own choice stands."""
    return _platform.machine().lower() in ("x86_64", "amd64") and "avx2" in _cpu_flags()


def effective_mode(environ=None) -> str:
    return requested_mode(environ) if _portable_possible() else "native"


def apply(environ=None) -> str:
    """Set the kernel pins of the requested mode in the environment (before torch runs anything); the mode in force.
    In portable mode the pins win over a user's own ATEN_CPU_CAPABILITY / MKL_CBWR, which would undo them."""
    environ = os.environ if environ is None else environ
    mode = effective_mode(environ)
    if mode == "portable":
        environ.update(PORTABLE_ENV)
    if "torch" in sys.modules:
        configure_torch()
    return mode


def configure_torch() -> None:
    """oneDNN off in portable mode; a warning when torch already chose other kernels than the mode's."""
    import torch

    if effective_mode() != "portable":
        return
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2" and not _warned:
        _warned.append(capability)
        logger.warning(
            "%s=portable: torch already runs its %s kernels in this process (set %s or call "
            "saeflow.numerics.apply() before the first torch operation); results are bitwise reproducible on "
            "this instruction set only", ENV_VAR, capability, ENV_VAR,
        )


def platform() -> dict:
    """What decides the float bytes of a CPU result (and, via provenance, a GPU's): recorded, never hashed."""
    torch = sys.modules.get("torch")
    info = {
        "numerics": effective_mode(),
        "machine": _platform.machine(),
        "cpu_model": _cpu_model(),
    }
    if torch is not None:
        info.update(
            torch_version=str(torch.__version__),
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            mkldnn_enabled=bool(torch.backends.mkldnn.enabled),
            onednn_version=_onednn_version(torch),
            mkl_version=_mkl_version(torch),
            mkl_cbwr=os.environ.get("MKL_CBWR"),
            n_threads=torch.get_num_threads(),
        )
    return info


def platform_key(info: dict) -> tuple:
    """The part of `platform()` (and the GPU provenance) under which two results are expected bitwise equal."""
    keys = ("machine", "cpu_model", "numerics", "torch_version", "cpu_capability", "mkldnn_enabled", "gpu",
            "cuda_version", "cudnn_version")  # fmt: skip
    return tuple(info.get(key) for key in keys)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fd:
            for line in fd:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or None


def _onednn_version(torch) -> str | None:
    """oneDNN's version as torch.__config__.show() names it ("v3.12.0"); it changes oneDNN's kernels."""
    match = re.search(r"MKL-DNN (v[0-9.]+)", torch.__config__.show())
    return match.group(1) if match else None


def _mkl_version(torch) -> str | None:
    match = re.search(r"Math Kernel Library Version ([0-9.]+)", torch.__config__.show())
    return match.group(1) if match else None
