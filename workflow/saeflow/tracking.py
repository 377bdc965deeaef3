"""Optional experiment tracking: every metrics.jsonl record of a run mirrored to Weights & Biases and/or TensorBoard.

    settings = tracking.Settings.from_section(config["train"])     # backends (none by default), dir, W&B project
    tracker = tracking.open_tracker(settings, run, start_step)      # one per run, after its resume point is known
    tracker.log(record)                                             # each metrics line (the same dict)
    tracker.close(final=result)                                     # the validation metrics; final=None: stopped

The run directory is content-addressed and read-only once published, so tracking files live outside it, under
`tracking_dir/<run_id>/` (TensorBoard event files; W&B's own `wandb/` directory). W&B runs offline unless
WANDB_MODE says otherwise (compute nodes often have no network; `wandb sync` uploads later). A resumed run logs no
step twice: TensorBoard drops the events after the resume step (purge_step), W&B resumes the run by id and keeps
the steps it already has (the retrained steps are identical: training resumes exactly).
"""

import dataclasses
import importlib
import math
import os
import pathlib

from saeflow import runs
from saeflow.errors import SaeflowError

BACKENDS = ("wandb", "tensorboard")
INSTALL_HINT = "pip install 'saeflow[tracking]'"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The `train` section's tracking keys."""

    backends: tuple[str, ...] = ()  # wandb, tensorboard; empty: metrics.jsonl only
    dpath: pathlib.Path = pathlib.Path("logs/tracking")  # tracking_dir: TensorBoard in <dpath>/<run_id>/
    wandb_project: str = "saeflow"

    @classmethod
    def from_section(cls, section: dict) -> "Settings":
        backends = tuple(dict.fromkeys(section.get("tracking") or ()))
        unknown = [name for name in backends if name not in BACKENDS]
        if unknown:
            raise SaeflowError(f"train.tracking: unknown backend {unknown[0]!r}; known: {', '.join(BACKENDS)}")
        for name in backends:
            _require(name)
        dpath = pathlib.Path(os.path.expanduser(os.path.expandvars(section.get("tracking_dir") or "logs/tracking")))
        return cls(backends, dpath, section.get("wandb_project") or "saeflow")


def _require(name: str):
    module = {"wandb": "wandb", "tensorboard": "torch.utils.tensorboard"}[name]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SaeflowError(f"train.tracking: {name} is not installed; {INSTALL_HINT}") from None


def _scalars(record: dict) -> dict[str, float]:
    """The numeric, finite fields of a metrics record (step and flags aside)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in ("step", "final")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


class _TensorBoard:
    def __init__(self, settings: Settings, run: runs.Run, start_step: int):
        summary = _require("tensorboard")
        log_dpath = settings.dpath / run.root.name / "tensorboard"
        self.writer = summary.SummaryWriter(str(log_dpath), purge_step=start_step or None)

    def log(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(f"train/{key}", value, record["step"])

    def close(self, final: dict | None) -> None:
        if final is not None:
            for key, value in _scalars(final).items():
                self.writer.add_scalar(f"val/{key}", value, final["step"])
        self.writer.close()


class _WandB:
    def __init__(self, settings: Settings, run: runs.Run, start_step: int):
        wandb = _require("wandb")
        settings.dpath.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.wandb_project,
            id=run.root.name[:32],  # W&B ids are short; 128 bits of the run id
            name=run.root.name[:12],
            config=run.config(),
            dir=str(settings.dpath),
            mode=os.environ.get("WANDB_MODE", "offline"),
            resume="allow",
            reinit="create_new",  # a pass trains several runs in one process
        )

    def log(self, record: dict) -> None:  # W&B ignores a step it already has (a resumed run relogs them)
        self.run.log({f"train/{k}": v for k, v in _scalars(record).items()}, step=record["step"])

    def close(self, final: dict | None) -> None:
        if final is not None:
            self.run.summary.update({f"val/{k}": v for k, v in _scalars(final).items()})
        self.run.finish(exit_code=0 if final is not None else 1)


class Tracker:
    """One run's trackers; a no-op without backends."""

    def __init__(self, backends: list):
        self.backends = backends

    def log(self, record: dict) -> None:
        for backend in self.backends:
            backend.log(record)

    def close(self, final: dict | None = None) -> None:
        for backend in self.backends:
            backend.close(final)
        self.backends = []


def open_tracker(settings: Settings | None, run: runs.Run, start_step: int) -> Tracker:
    """The run's trackers, opened at `start_step` (0, or the resume point)."""
    kinds = {"wandb": _WandB, "tensorboard": _TensorBoard}
    return Tracker([kinds[name](settings, run, start_step) for name in (settings.backends if settings else ())])
