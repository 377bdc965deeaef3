"""zarr-python 2.18 and 3.x behind the few calls the Zarr store makes; both write and read Zarr format 2.

The store stays Zarr v2 on disk (specs/zarr-activation-logger.md), whichever zarr-python is installed: with 3.x
every group is opened with `zarr_format=2` (its arrays inherit it), arrays are made with `create_array` and the
v2 codec spelling (`compressors=` one numcodecs codec or None, `filters=None`), and `.zmetadata` is written by
`consolidate_metadata(..., zarr_format=2)`. Codecs and empty-chunk handling are spelled out rather than left to
defaults, which differ (3.x compresses new v2 arrays with zstd and skips chunks equal to the fill value; 2.18 uses
blosc-lz4 and writes every chunk), so both versions write the same `.zarray` fields and the same chunk files.
zarr is imported on first use: the CLI must start without it.
"""

import asyncio
import contextlib
import functools
import pathlib
import typing
import warnings

# The small per-sample arrays' compressor: zarr-python 2.18's default (blosc lz4, level 5, byte shuffle), named
# so that 3.x writes it too. Activation arrays use none (the spec).
SMALL_COMPRESSOR = {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0}


@functools.cache
def major() -> int:
    import zarr

    return int(zarr.__version__.split(".")[0])


def _v2() -> dict:
    """The keyword that pins Zarr format 2 under zarr-python 3 (2.18 writes only format 2 and lacks it)."""
    return {"zarr_format": 2} if major() >= 3 else {}


def new_group(dpath: pathlib.Path):
    """A new, empty format-2 root group at dpath."""
    import zarr

    return zarr.open_group(str(dpath), mode="w", **_v2())


def create_array(group, name: str, shape, chunks, dtype, fill_value, compressor: dict | None = None):
    """A C-order format-2 array without filters; `compressor` is a numcodecs config (None = raw chunks)."""
    import numcodecs

    codec = None if compressor is None else numcodecs.get_codec(dict(compressor))
    kwargs = {"shape": tuple(shape), "chunks": tuple(chunks), "dtype": dtype, "fill_value": fill_value,
              "filters": None, "order": "C"}
    if major() >= 3:
        return group.create_array(name, compressors=codec, config={"write_empty_chunks": True}, **kwargs)
    return group.create_dataset(name, compressor=codec, write_empty_chunks=True, **kwargs)


@contextlib.contextmanager
def settled_on_error() -> typing.Iterator[None]:
    """On an exception, wait for zarr's in-flight chunk writes before passing it on. zarr-python 3 writes an
    assignment's chunks as concurrent tasks (`asyncio.gather`), and the first to fail (a full disk) does not cancel
    the others: they go on writing, creating directories, after the caller has removed its staging directory. 2.18
    writes synchronously: nothing to wait for."""
    try:
        yield
    except BaseException:
        if major() >= 3:
            from zarr.core.sync import sync

            sync(_others_done())
        raise


async def _others_done() -> None:
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    await asyncio.gather(*others, return_exceptions=True)


def consolidate(dpath: pathlib.Path) -> None:
    """Write `.zmetadata` (format 2 consolidated metadata) for the store at dpath."""
    import zarr

    with warnings.catch_warnings():  # 3.x notes the spec's text/ folder of JSONL files is no zarr node: it is not
        warnings.filterwarnings("ignore", message=".* is not recognized as a component of a Zarr hierarchy")
        zarr.consolidate_metadata(str(dpath), **_v2())


def open_consolidated(dpath: pathlib.Path):
    """The store's root group, read-only, from its `.zmetadata`."""
    import zarr

    return zarr.open_consolidated(str(dpath), mode="r", **_v2())

