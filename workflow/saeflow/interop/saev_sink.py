"""Records -> a saev protocol 2.0 shard directory (via `shards.ShardWriter`), so imported data can be trained on.

The saev layout is (n_ex, L, T, D) with one T for every example, so every record must have the same number of
tokens. The metadata's `data` object carries the source format and the checksums of its files, so the shard
hash changes exactly when the imported bytes do (and not when the source directory moves).
"""

import itertools
import typing

import numpy as np
import tqdm

from saeflow.errors import SaeflowError
from saeflow.interop.records import Record, check_uniform
from saeflow.store import shards

BLOCK_EX = 64


def write(
    records: typing.Iterable[Record],
    n_ex: int,
    shards_root,
    family: str,
    ckpt: str,
    dataset: str,
    data: dict,
    patches_per_shard: int = shards.DEFAULT_PATCHES_PER_SHARD,
) -> shards.ShardDir:
    """Stream `n_ex` fixed-length records into `<shards_root>/<hash>/`; reuses an identical published directory."""
    records = iter(records)
    first = next(records, None)
    if first is None:
        raise SaeflowError("saev import: no examples")
    layers, d_model = check_uniform([first], "saev import")
    n_tokens = first.n_tokens
    md = shards.Metadata(
        family=family, ckpt=ckpt, layers=layers, patches_per_ex=n_tokens, cls_token=False, d_model=int(d_model),
        n_ex=n_ex, patches_per_shard=max(patches_per_shard, n_tokens * len(layers)), data=data, dataset=dataset,
    )
    with shards.ShardWriter(shards_root, md, provenance_extra={"imported_from": data}) as writer:
        if writer.reused:
            return shards.ShardDir(writer.dpath)
        remaining = itertools.islice(itertools.chain([first], records), writer.n_written, None)
        bar = tqdm.tqdm(total=n_ex, initial=writer.n_written, desc="import to saev shards", unit="ex")
        while block := list(itertools.islice(remaining, BLOCK_EX)):
            for i, rec in enumerate(block):
                if rec.layers != layers or any(rec.acts[layer].shape != (n_tokens, d_model) for layer in layers):
                    shapes = {layer: rec.acts[layer].shape for layer in rec.layers}
                    raise SaeflowError(
                        f"saev import: example {writer.n_written + i} has shapes {shapes}; saev shards need every "
                        f"example to have layers {list(layers)} of shape ({n_tokens}, {d_model})"
                    )
            writer.write(np.stack([np.stack([rec.acts[layer] for layer in layers]) for rec in block]))
            bar.update(len(block))
        bar.close()
        if writer.n_written != n_ex:
            raise SaeflowError(f"saev import: got {writer.n_written} examples, the source declares {n_ex}")
    return shards.ShardDir(writer.dpath)
