"""The labels each latent predicts, on the latent pages: `visuals/labels.js` of an inference dump.

`saeflow probe` writes RUN/probe/<shard_hash>.json; the latent browser (saeflow.analysis.visuals) shows, on every
latent's page, the labels among whose 20 latents of largest mean difference that latent is. `saeflow visuals` writes
labels.js when it draws (from the probe result of the same checkpoint, or a note that there is none), and
`saeflow probe` replaces it in the drawn visuals when it runs (one atomic rename under the visuals' lock), so the
page always shows the newest probe of the dump's checkpoint. No torch here: probing a dump imports neither it nor
the visuals.
"""

import contextlib
import json
import pathlib
import typing

from saeflow.store import atomic, layout

N_LABELS_SHOWN = 10  # labels listed per latent, the best single latent's first, then highest held-out AUROC


@contextlib.contextmanager
def writable_dir(dpath: pathlib.Path) -> typing.Iterator[None]:
    """Let a read-only, published directory take one new entry, then make it read-only again."""
    dpath.chmod(0o755)
    try:
        yield
    finally:
        dpath.chmod(atomic.READONLY_DIR_MODE)


def probe_result_of(run_dpath: pathlib.Path, shard_hash: str, sae_sha256: str | None) -> dict | None:
    """The run's probe result on shards `shard_hash` when it was made from checkpoint `sae_sha256`, else None."""
    fpath = layout.RunLayout(run_dpath).probe_fpath(shard_hash)
    if not fpath.exists():
        return None
    result = json.loads(fpath.read_text(encoding="utf-8"))
    return result if result.get("config", {}).get("sae_sha256") == sae_sha256 else None


def labels_js(probe_result: dict | None, labelled: bool = True) -> bytes:
    """visuals/labels.js: per latent, the labels among whose 20 latents of largest mean difference it is, as
    [label, held-out AUROC, rank by mean difference, best single latent?]; a note when there is no probe yet.
    Pages of shards without labels (`labelled` False) show no labels section."""
    by_latent: dict[str, list] = {}
    for entry in (probe_result or {}).get("labels", []):
        best = entry.get("best_latent", {}).get("latent")
        for rank, (latent, _, auroc) in enumerate(entry.get("candidates", []), start=1):
            by_latent.setdefault(str(latent), []).append([entry["name"], auroc, rank, latent == best])
    for rows in by_latent.values():
        rows.sort(key=lambda row: (-row[3], -row[1], row[2]))
        del rows[N_LABELS_SHOWN:]
    note = "" if probe_result else "not probed: `saeflow probe` scores the labels of shards with labels.bin or " \
        "classes.bin"
    obj = {"labelled": labelled or probe_result is not None, "note": note, "latents": by_latent}
    return ("window.SAEFLOW_LABELS = " + json.dumps(obj, separators=(",", ":")) + ";\n").encode("utf-8")


def write_labels_page(dump: layout.DumpLayout, probe_result: dict) -> None:
    """Put a new probe result on the dump's drawn latent pages: visuals/labels.js replaced atomically (under the
    visuals' lock, the read-only directory writable for the one rename). Undrawn visuals read it when drawn."""
    with atomic.exclusive_lock(dump.visuals_lock_fpath):
        if not dump.index_fpath.exists():
            return
        with writable_dir(dump.visuals_dpath):
            atomic.write_file_atomic(dump.labels_js_fpath, labels_js(probe_result), readonly=True)
