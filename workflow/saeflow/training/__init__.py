"""Training: SAE sweeps -> run configs -> trained SAEs (loaders, the SAE family, the loss, the resumable loop)."""
