"""SAE checkpoints of SAELens and sparsify: read as untrusted input, written from a run, and the hook names they use."""
