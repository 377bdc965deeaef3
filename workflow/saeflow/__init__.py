"""saeflow: reproducible, content-addressed sparse-autoencoder workflows on transformer activations."""

__version__ = "0.1.0"
