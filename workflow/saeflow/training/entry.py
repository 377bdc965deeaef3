"""`saeflow train`'s entry: a process that a launcher made one rank of several (saeflow.training.ranks.distributed)
trains with the others (saeflow.training.ranks.parallel, in the `parallel` mode); any other process trains alone
(saeflow.training.train). It sits above both, so the one-process loop never imports the ranks' loop."""

import os
import typing

from saeflow.errors import SaeflowError
from saeflow.store import runs
from saeflow.training import clt_train, train
from saeflow.training.ranks import distributed, parallel
from saeflow.training.train import DEFAULT_SETTINGS, TrainSettings


def train_runs(run_paths: typing.Sequence[str | os.PathLike], settings: TrainSettings = DEFAULT_SETTINGS) -> list[dict]:
    """train.train_runs in one process (a cross-layer transcoder's pass opened by clt_train); on the ranks of a
    launched job parallel.train_runs, whose results are rank 0's (an empty list elsewhere), which trains no CLT."""
    if distributed.rendezvous_from_env() is None:
        return train.train_runs(run_paths, settings, open_clt=clt_train.open_pass)
    for path in run_paths:
        if runs.open_run(path).config().get("shape") == "clt":
            raise SaeflowError(f"{path}: a cross-layer transcoder trains on one process; train it without --gpus, "
                               "--nodes or a launcher")  # fmt: skip
    return parallel.train_runs(parallel.join(settings.device), run_paths, settings)
