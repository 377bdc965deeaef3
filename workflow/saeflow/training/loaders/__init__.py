"""Readers of one layer's vectors from a saev shard directory: shuffled (training), ordered (inference), indexed.

    view.py      LayerView: where a layer's selected tokens live, how they are numbered; IndexedReader
    ordered.py   OrderedLoader: storage order, read ahead by two threads
    shuffled.py  ShuffledLoader: a uniform mix from a RAM pool refilled by a permuted stream of blocks (EpochPlan)
    pairs.py     a transcoder's (input, target) batches: PairedOrderedLoader, and split/to_device for either kind
"""

from saeflow.training.loaders import pairs
from saeflow.training.loaders.ordered import OrderedLoader
from saeflow.training.loaders.pairs import PairedOrderedLoader, ordered_loader
from saeflow.training.loaders.shuffled import DEFAULT_BUFFER_BYTES, EpochPlan, ShuffledLoader
from saeflow.training.loaders.view import TOKENS, Block, IndexedReader, LayerView, TokenSelection

__all__ = ["DEFAULT_BUFFER_BYTES", "TOKENS", "Block", "EpochPlan", "IndexedReader", "LayerView", "OrderedLoader",
           "PairedOrderedLoader", "ShuffledLoader", "TokenSelection", "ordered_loader", "pairs"]
