"""The one resolver of torch device names: `auto` is CUDA when a GPU is visible, else the CPU."""

from saeflow.errors import SaeflowError


def resolve_device(name: str):
    """A `torch.device` for a config or CLI device name; a clear error for a bad name or a missing GPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise SaeflowError(f"unknown device {name!r} ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SaeflowError(f"device {name!r} asked for, but CUDA is not available here")
    return device
