"""saeflow's Adam against torch.optim.Adam: the same bytes after every step (torch's single-tensor update on CPU and
its foreach update), state_dicts that load both ways, and no torch._dynamo import (the reason it exists)."""

import io
import subprocess
import sys

import pytest
import torch

from saeflow.training.adam import Adam
from workflow_helpers import REPO_ROOT, env


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(48, 24), (24,), (24, 48), (48,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]


def _train(params, opt, steps: range) -> None:
    """Steps with a changing learning rate (warm-up and decay set it per step) and one parameter without a gradient
    in every third step (torch skips it and keeps its state)."""
    for t in steps:
        opt.param_groups[0]["lr"] = 1e-3 * (1 + t % 4)
        opt.zero_grad()
        used = params if t % 3 else params[:-1]
        loss = sum((p.sin() * p).sum() for p in used) + (params[0] @ params[2]).square().mean()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("foreach", [None, True], ids=["single-tensor", "foreach"])
def test_every_step_is_torch_adams_bit_for_bit(foreach):
    ours, theirs = _params(), _params()
    opt_ours, opt_theirs = Adam(ours, lr=1e-3), torch.optim.Adam(theirs, lr=1e-3, foreach=foreach)
    for t in range(12):
        _train(ours, opt_ours, range(t, t + 1))
        _train(theirs, opt_theirs, range(t, t + 1))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), t


def test_a_parameters_learning_rate_scale_is_torchs_own_group_at_that_rate():
    """`lr_scales` (an architecture's `Arch.lr_scales`, e.g. JumpReLU's thresholds): the scaled parameter moves as in a
    torch.optim.Adam group of its own at lr x scale (to rounding: the product is taken in another order), the rest
    bit for bit as before."""
    ours, theirs = _params(), _params()
    opt_ours = Adam(ours, lr=1e-3, lr_scales=[1, 1, 4, 1])
    opt_theirs = torch.optim.Adam([{"params": [theirs[i] for i in (0, 1, 3)]}, {"params": [theirs[2]], "lr": 4e-3}],
                                  lr=1e-3)  # fmt: skip
    for _ in range(6):
        for opt, params in ((opt_ours, ours), (opt_theirs, theirs)):
            opt.zero_grad()
            ((params[0] @ params[2]).square().mean() + sum((p.sin() * p).sum() for p in params)).backward()
            opt.step()
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(ours[i], theirs[i]) for i in (0, 1, 3))
    with pytest.raises(ValueError, match="2 learning-rate scales for 4 parameters"):
        Adam(_params(), lr=1e-3, lr_scales=[1, 2])


def test_state_dicts_load_both_ways_and_training_goes_on_identically():
    ours, theirs = _params(), _params()
    opt_ours, opt_theirs = Adam(ours, lr=1e-3), torch.optim.Adam(theirs, lr=1e-3)
    _train(ours, opt_ours, range(5))
    _train(theirs, opt_theirs, range(5))
    ours_sd, theirs_sd = opt_ours.state_dict(), opt_theirs.state_dict()
    assert ours_sd["param_groups"] == theirs_sd["param_groups"]
    assert ours_sd["state"].keys() == theirs_sd["state"].keys()
    for i, moments in theirs_sd["state"].items():
        assert moments.keys() == ours_sd["state"][i].keys()
        assert all(torch.equal(t, ours_sd["state"][i][key]) for key, t in moments.items())
    # A resume.pt written by torch.optim.Adam (saeflow before this class) continues in ours, and the other way.
    resumed_a, resumed_b = ([torch.nn.Parameter(p.detach().clone()) for p in ours] for _ in range(2))
    opt_a, opt_b = Adam(resumed_a, lr=0.5), torch.optim.Adam(resumed_b, lr=0.5)
    opt_a.load_state_dict(_saved_and_loaded(theirs_sd))
    opt_b.load_state_dict(_saved_and_loaded(ours_sd))
    for params, opt in ((resumed_a, opt_a), (resumed_b, opt_b), (ours, opt_ours)):
        _train(params, opt, range(5, 9))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(resumed_a, resumed_b, ours, strict=True))


def _saved_and_loaded(state_dict: dict) -> dict:
    """Through torch.save and torch.load, as resume.pt is."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_a_state_dict_for_other_parameters_is_refused():
    opt = Adam(_params(), lr=1e-3)
    with pytest.raises(ValueError, match="optimizer state for 3 parameters, not 4"):
        opt.load_state_dict({"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1, 2]}]})


@pytest.mark.slow
def test_building_and_stepping_imports_no_dynamo():
    code = (
        "import sys, torch\n"
        "from saeflow.training.adam import Adam\n"
        "p = torch.nn.Parameter(torch.zeros(3)); opt = Adam([p], lr=1e-3); p.grad = torch.ones(3); opt.step()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env(PYTHONPATH=str(REPO_ROOT / "workflow")),
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert proc.stdout.strip() == "False"
