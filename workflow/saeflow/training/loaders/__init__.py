"""Readers of one layer's vectors from a saev shard directory: shuffled (training), ordered (inference), indexed.

    view.py      LayerView: where a layer's selected tokens live, how they are numbered; IndexedReader
    ordered.py   OrderedLoader: storage order, read ahead by two threads
    shuffled.py  ShuffledLoader: a uniform mix from a RAM pool refilled by a permuted stream of blocks (EpochPlan)
"""

from saeflow.training.loaders.ordered import OrderedLoader
from saeflow.training.loaders.shuffled import DEFAULT_BUFFER_BYTES, EpochPlan, ShuffledLoader
from saeflow.training.loaders.view import TOKENS, Block, IndexedReader, LayerView, TokenSelection

__all__ = ["DEFAULT_BUFFER_BYTES", "TOKENS", "Block", "EpochPlan", "IndexedReader", "LayerView", "OrderedLoader",
           "ShuffledLoader", "TokenSelection"]
