"""The SAE architectures: one module each (its `ARCH`), listed here. Every trainer, the planner, the stages and the
interop formats ask this registry (`get(name)`), never compare a name (tests/test_house.py).

Adding an architecture: a module here defining an `Arch` subclass and `ARCH` (docs/architecture.md, "Where to
add"; the registry is every module here but `base`), its name in the schema's `sae_spec.arch` enum, its keys in the
schema (and in `training.keys.INTRODUCED`, so no existing run id moves) and in its `Arch.hyper` (the keys it reads).
The registry-wide tests (tests/test_archs.py, tests/test_read_keys.py, tests/test_transcoders.py, tests/test_identity.py
and the equivalence and resume tests of every parallel mode) ask `names` for the architectures that claim a mode or
shape, so they cover it in what it declares, or fail until it handles or refuses it.
"""

import importlib
import pkgutil

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.training.archs.base import MODES, Arch, Selection, TermInputs, Unsupported, made_since

MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"))  # each defines ARCH
REGISTRY: dict[str, Arch] = {arch.name: arch for arch in (importlib.import_module(f"{__name__}.{m}").ARCH
                                                           for m in MODULES)}  # fmt: skip
NAMES = config.enum("sae_spec", "arch")  # the schema's list; tests/test_archs.py checks it is the registry's


def get(name: str) -> Arch:
    """The architecture named `name`, or one line naming the choices."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise SaeflowError(f"arch: unknown SAE architecture {name!r}; choose one of {tuple(REGISTRY)}") from None


def trains_in(arch: Arch, transcoder: bool = False) -> tuple[str, ...]:
    """The parallel modes `arch` trains in as an SAE, or as a transcoder (`transcoder`: none where it has no
    transcoder, `Arch.transcodes`)."""
    if not transcoder:
        return arch.modes
    return tuple(m for m in arch.modes if m in arch.transcoder_modes) if arch.transcodes else ()


def names(mode: str | None = None, transcoder: bool = False, uses_k: bool | None = None) -> list[str]:
    """The registered architectures (sorted names) that claim what is asked: to train in `mode` (None: in some
    mode), as a transcoder (`transcoder`), and k-sparse or not (`uses_k`, when given). What a registry-wide test
    iterates, so it runs an architecture in exactly what it declares."""
    return sorted(name for name, arch in REGISTRY.items()
                  if trains_in(arch, transcoder) and (mode is None or mode in trains_in(arch, transcoder))
                  and (uses_k is None or arch.uses_k == uses_k))  # fmt: skip


def check_mode(name: str, mode: str, where: str = "arch", transcoder: bool = False, cfg=None) -> None:
    """Refuse, in one line, a parallel mode the architecture does not train in (as a transcoder: `transcoder`), or
    not with the run's config `cfg` (`Arch.mode_refusal`)."""
    modes = trains_in(get(name), transcoder)
    if mode in MODES and mode not in modes:
        what = f"{name} transcoders" if transcoder else f"{name} SAEs"
        raise SaeflowError(f"{where}: {what} do not train with parallel: {mode} (they train with "
                           f"{', '.join(modes)})")  # fmt: skip
    refusal = None if cfg is None or mode not in MODES else get(name).mode_refusal(cfg, mode)
    if refusal:
        raise SaeflowError(f"{where}: {refusal}")


def check(cfg) -> None:
    """Refuse, in one line, what the run's architecture cannot train: its own hyper-parameters (`Arch.check`) and a
    transcoder where it has none (`Arch.transcodes`)."""
    arch = get(cfg.arch)
    arch.check(cfg)
    if cfg.transcoder and not arch.transcodes:
        raise SaeflowError(f"arch: {cfg.arch} has no transcoder (set target: null, or an architecture that "
                           f"transcodes: {', '.join(names(transcoder=True))})")  # fmt: skip


def from_saelens(saelens_name: str, cfg: dict, transcoder: bool = False) -> Arch:
    """The architecture a SAELens checkpoint is (a `transcoder`: `saelens_transcoder`): among those saved under its
    SAELens name, the first (by name) whose `saelens_claims(cfg)` says so, the one whose claim is unconditional last.
    A skip transcoder's name is its transcoder's with `skip_` before `transcoder`."""
    saved_as = (lambda arch: arch.saelens_transcoder) if transcoder else (lambda arch: arch.saelens)
    lookup = saelens_name.replace("skip_transcoder", "transcoder") if transcoder else saelens_name
    candidates = [arch for arch in REGISTRY.values() if saved_as(arch) == lookup]
    if not candidates:
        known = sorted({name for arch in REGISTRY.values() for name in (arch.saelens, arch.saelens_transcoder) if name})
        raise Unsupported(f"SAELens architecture {saelens_name!r} (saeflow has {known}, and the skip_ variants "
                          "of the transcoders)")  # fmt: skip
    fallback = [arch for arch in candidates if type(arch).saelens_claims is Arch.saelens_claims]
    claimed = [arch for arch in candidates if arch not in fallback and arch.saelens_claims(cfg)]
    return (claimed or fallback or candidates)[0]


__all__ = ["MODES", "NAMES", "REGISTRY", "Arch", "Selection", "TermInputs", "Unsupported", "check", "check_mode", "get",
           "made_since", "names", "trains_in"]
