"""Optional experiment tracking: every metrics.jsonl record of a run mirrored to Weights & Biases and/or TensorBoard.

    settings = tracking.Settings.from_section(config["train"])     # backends (none by default), dir, W&B project
    tracker = tracking.open_tracker(settings, run, start_step)      # one per run, after its resume point is known
    tracker.log(record)                                             # each metrics line (the same dict)
    tracker.close(final=result)                                     # the validation metrics; final=None: stopped

The run directory is content-addressed and read-only once published, so tracking files live outside it, under
`tracking_dir` (TensorBoard event files in `<run_id>/tensorboard/`; W&B's own `wandb/` directory). W&B runs offline
unless WANDB_MODE says otherwise (compute nodes often have no network; `wandb sync` uploads later).

A resumed run logs no step twice, like metrics.jsonl, which keeps the lines up to the resume step and logs the rest
again: TensorBoard drops the events after the resume step (purge_step), and W&B, which cannot drop steps, gets only
steps after the last one it was given (`<run_id>/<project>.wandb_step`; the steps logged again are identical
anyway, since training resumes exactly). An offline W&B run cannot resume, so each restart writes one more offline
run directory with the same id; their steps never overlap.
"""

import dataclasses
import importlib
import math
import os
import pathlib

from saeflow import config
from saeflow.errors import SaeflowError
from saeflow.store import runs

BACKENDS = config.enum("train", "tracking")
INSTALL_HINT = "pip install 'saeflow[tracking]'"
DEFAULTS = config.section_defaults("train")  # tracking, tracking_dir, wandb_project: the schema's `train` keys


@dataclasses.dataclass(frozen=True)
class Settings:
    """The `train` section's tracking keys."""

    backends: tuple[str, ...] = tuple(DEFAULTS["tracking"])  # wandb, tensorboard; empty: metrics.jsonl only
    dpath: pathlib.Path = pathlib.Path(DEFAULTS["tracking_dir"])  # tracking_dir: TensorBoard in <dpath>/<run_id>/
    wandb_project: str = DEFAULTS["wandb_project"]

    @classmethod
    def from_section(cls, section: dict) -> "Settings":
        backends = tuple(dict.fromkeys(section.get("tracking") or ()))
        unknown = [name for name in backends if name not in BACKENDS]
        if unknown:
            raise SaeflowError(f"train.tracking: unknown backend {unknown[0]!r}; known: {', '.join(BACKENDS)}")
        for name in backends:
            _require(name)
        dpath = os.path.expanduser(os.path.expandvars(section.get("tracking_dir") or DEFAULTS["tracking_dir"]))
        return cls(backends, pathlib.Path(dpath), section.get("wandb_project") or DEFAULTS["wandb_project"])


def _require(name: str):
    module = config.by_enum({"wandb": "wandb", "tensorboard": "torch.utils.tensorboard"}, "train", "tracking")[name]
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
        # Events at steps > start_step go (metrics.jsonl keeps the lines up to it); at 0 those of an attempt that
        # stopped before its first resume point.
        self.writer = summary.SummaryWriter(str(log_dpath), purge_step=start_step + 1)

    def log(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(f"train/{key}", value, record["step"])
        self.writer.flush()  # on disk like its metrics.jsonl line: a kill loses no step before the resume point

    def close(self, final: dict | None) -> None:
        if final is not None:
            for key, value in _scalars(final).items():
                self.writer.add_scalar(f"val/{key}", value, final["step"])
        self.writer.close()


class _WandB:
    def __init__(self, settings: Settings, run: runs.Run, start_step: int):
        wandb = _require("wandb")
        # The last step this W&B run (project, id) was given.
        self.step_fpath = settings.dpath / run.root.name / f"{settings.wandb_project}.wandb_step"
        self.step_fpath.parent.mkdir(parents=True, exist_ok=True)
        self.last_step = _read_step(self.step_fpath)
        self.run = wandb.init(
            project=settings.wandb_project,
            id=run.root.name[:32],  # W&B ids are short; 128 bits of the run id
            name=run.root.name[:12],
            config=run.config(),
            dir=str(settings.dpath),
            mode=os.environ.get("WANDB_MODE") or "offline",  # read here: W&B reads it once per process
            resume="allow",
            reinit="create_new",  # a pass trains several runs in one process
        )

    def log(self, record: dict) -> None:
        if record["step"] <= self.last_step:  # W&B has it already: logged before a kill, logged again on resume
            return
        self.run.log({f"train/{k}": v for k, v in _scalars(record).items()}, step=record["step"])
        self.last_step = record["step"]
        self.step_fpath.write_text(f"{self.last_step}\n")

    def close(self, final: dict | None) -> None:
        if final is not None:
            self.run.summary.update({f"val/{k}": v for k, v in _scalars(final).items()})
        self.run.finish(exit_code=0 if final is not None else 1)


def _read_step(fpath: pathlib.Path) -> int:
    """The step a file holds; -1 when there is none (or a kill tore the file: then steps may be logged twice)."""
    try:
        return int(fpath.read_text())
    except (OSError, ValueError):
        return -1


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
    kinds = config.by_enum({"wandb": _WandB, "tensorboard": _TensorBoard}, "train", "tracking")
    return Tracker([kinds[name](settings, run, start_step) for name in (settings.backends if settings else ())])
