"""Adam as torch.optim.Adam computes it with its defaults, bit for bit, without importing torch.optim's machinery.

Building or stepping a torch.optim optimizer imports torch._dynamo (its compile guards): 1 to 1.5 s of CPU in every
training process and every rank, which is more than a small run's whole training. This is torch's update for
non-capturable Adam (betas 0.9/0.999, eps 1e-8, no weight decay) in the foreach form torch runs on CUDA; on CPU the
foreach ops run tensor by tensor, which is torch's single-tensor update. `state_dict()` has torch.optim.Adam's
layout, so a resume.pt written by either loads into the other (tests/test_adam.py checks both and the bytes).
"""

import torch

BETA1, BETA2 = 0.9, 0.999
EPS = 1e-8
# The rest of a torch.optim.Adam param group, as its state_dict holds it.
TORCH_GROUP = {
    "betas": (BETA1, BETA2), "eps": EPS, "weight_decay": 0, "amsgrad": False, "maximize": False, "foreach": None,
    "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": False,
}  # fmt: skip


class Adam:
    """One parameter group; `param_groups[0]["lr"]` is the learning rate of the next `step()`. `lr_scales`: a
    multiple of it per parameter (default 1 each: an architecture's `Arch.lr_scales`), the update torch.optim.Adam
    makes with those parameters in a group of their own at lr x scale (not state: resume.pt keeps torch's layout)."""

    def __init__(self, params, lr: float, lr_scales=None):
        self.params = list(params)
        self.lr_scales = [1.0] * len(self.params) if lr_scales is None else [float(s) for s in lr_scales]
        if len(self.lr_scales) != len(self.params):
            raise ValueError(f"{len(self.lr_scales)} learning-rate scales for {len(self.params)} parameters")
        self.param_groups = [{"lr": lr, **TORCH_GROUP, "params": self.params}]
        self.state: dict[int, dict[str, torch.Tensor]] = {}  # parameter index -> step, exp_avg, exp_avg_sq
        self._denoms: dict[int, torch.Tensor] = {}  # parameter index -> `_denom`'s buffer

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, param in enumerate(self.params) if param.grad is not None]
        if not live:
            return
        params = [self.params[i] for i in live]
        grads = [param.grad for param in params]
        for i in live:
            if i not in self.state:  # the moments are made at a parameter's first gradient, as torch does
                self.state[i] = self._zero_state(self.params[i])
        states = [self.state[i] for i in live]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        for s in states:
            s["step"] += 1  # a CPU scalar: read below without a device sync
        torch._foreach_lerp_(exp_avgs, grads, 1 - BETA1)
        torch._foreach_mul_(exp_avg_sqs, BETA2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - BETA2)
        steps = [s["step"].item() for s in states]
        lr = self.param_groups[0]["lr"]
        step_sizes = [(lr / (1 - BETA1**step)) * -1 for step in steps]
        scales = [self.lr_scales[i] for i in live]
        step_sizes = [size if scale == 1.0 else size * scale for size, scale in zip(step_sizes, scales)]
        denoms = [torch.sqrt(v, out=self._denom(i, v)) for i, v in zip(live, exp_avg_sqs)]
        torch._foreach_div_(denoms, [(1 - BETA2**step) ** 0.5 for step in steps])
        torch._foreach_add_(denoms, EPS)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)

    def _denom(self, i: int, exp_avg_sq: torch.Tensor) -> torch.Tensor:
        """Parameter i's buffer for the update's denominator, kept between steps: a fresh one each step is a fresh
        allocation the size of the parameter, whose first touch page-faults (a third of the update's time at 2^27
        weights on the CPU). Not state: it is recomputed every step."""
        buf = self._denoms.get(i)
        if buf is None or buf.shape != exp_avg_sq.shape or buf.device != exp_avg_sq.device:
            buf = self._denoms[i] = torch.empty_like(exp_avg_sq)
        return buf

    @staticmethod
    def _zero_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
        exp_avg, exp_avg_sq = (torch.zeros_like(param, memory_format=torch.preserve_format) for _ in range(2))
        return {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def state_dict(self) -> dict:
        group = {key: value for key, value in self.param_groups[0].items() if key != "params"}
        return {"state": dict(self.state), "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """A state_dict of this class or of torch.optim.Adam over the same parameters, in the same order."""
        (group,) = state_dict["param_groups"]
        if len(group["params"]) != len(self.params):
            raise ValueError(f"optimizer state for {len(group['params'])} parameters, not {len(self.params)}")
        self.param_groups[0]["lr"] = group["lr"]
        self.state = {}
        for i, moments in state_dict["state"].items():
            param = self.params[int(i)]
            self.state[int(i)] = {
                "step": moments["step"],
                **{key: moments[key].to(param.device, param.dtype) for key in ("exp_avg", "exp_avg_sq")},
            }
