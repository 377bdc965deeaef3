"""`saeflow export`, `convert`, `import saev`, `export-checkpoint`, `import-checkpoint`: other tools' formats.

Datasets (lmprobe 2.0, Zarr, gzip-pickle, saev shard directories) and SAE checkpoints (SAELens, sparsify).
"""

import argparse
import pathlib

from saeflow import config
from saeflow.interop.budget import DEFAULT_MEMORY_BUDGET
from saeflow.interop.spec import CHECKPOINT_FORMATS, CIRCUIT_TRACER, SINK_FORMATS

EXPORT_DESCRIPTION = """\
Run a text model over a prompt dataset and write an interop dataset:

  lmprobe  lmprobe 2.0 (parquet index + per-layer safetensors): pooled last-token or full-sequence activations,
           top-k logits at the last token, perplexity columns; loads with lmprobe's own reader.
  zarr     Zarr v2 store of float16 prompt (and greedy-response) activations, chunks (1, 1, T, H), written as
           shard stores + manifest.json (optionally merged); random (sample, layer) reads.
  pickle   gzip-pickle shards + metadata.json with sha256 checksums.

Give either CONFIG --export NAME (an `exports` entry of the workflow config) or the ad-hoc flags --format,
--model, --prompts and --layers; both are validated against the same schema and get the same defaults.
Layer k is the output of transformer block k (as in `saeflow extract`). Zarr exports can run as parallel jobs:
`--part I` writes only shard store I; a run without --part writes what is missing, then manifest.json.
"""

CONVERT_DESCRIPTION = """\
Convert an lmprobe dataset, Zarr store/root or gzip-pickle shard directory (detected from its files) into
another format, through saeflow's in-memory per-example records. `--to saev` imports fixed-length activations
into a saev protocol 2.0 shard directory OUT/<sha256>/ (OUT is a shards root) so they can be trained on; the
shard hash covers the source's checksums. `--to saev2.1` exports a saeflow shard directory (a vision model's, float32)
as saev's own 2.1 directory OUT/<8 hex digits of saev's hash>/ (OUT ends in saev/shards) that saev's readers read:
saev's 13 metadata keys, shards hard-linked (a short last shard copied and zero-padded to saev's full size), the hook
point kept in saev's data; the source and its hash are untouched. gzip-pickle sources are checksum-verified and
unpickled with an allow-list (numpy arrays and plain containers only), never with pickle.load.

Sources are read as untrusted input within --memory-budget: declared sizes (pickle arrays and strings,
safetensors headers, .zarray shapes and chunks) are checked against the budget and the file sizes before anything
is allocated, and a gzip stream is cut off at the budget while it is decompressed. A refused file is named in a
one-line error.
"""

IMPORT_SAEV_DESCRIPTION = """\
Check a directory written by saev (metadata keys n_examples, content_tokens_per_example, max_tokens_per_shard,
pixel_agg, a base64-pickled data field, protocol 2.1; named by the first 8 hex digits of the sha256 of its metadata,
or by all 64 as saev's 2.1 commits before 075ac76 named it) by saev's own rules and publish it as a saev protocol 2.0
directory ROOT/<sha256>/ that saeflow trains on. Shard files become symlinks to the originals (nothing is copied)
except a padded last shard, which is trimmed into a copy; labels.bin is linked. saev's data pickle is decoded without
running it (saev dataset-config classes and paths only) into the protocol 2.0 `data` object; the original string is
kept under data.__saev__. checksums.json records every file; for linked shards that reads them once (about 1 GB/s
cold), unless --no-link-checksums. Importing again reuses the directory.
"""

EXPORT_CHECKPOINT_DESCRIPTION = """\
Write the SAE of RUN (checkpoint/sae.pt), or a transcoder set of one RUN per layer, as a directory the other library
loads with its own code:

  saelens   cfg.json + sae_weights.safetensors: sae_lens.SAE.load_from_disk(OUT) (relu -> standard, topk -> topk,
            batchtopk -> jumprelu with the BatchTopK threshold for every latent, jumprelu -> jumprelu with its
            per-latent thresholds, gated -> gated); transcoders: relu -> transcoder, jumprelu and batchtopk ->
            jumprelu_transcoder, skip_transcoder / jumprelu_skip_transcoder with a skip path
  sparsify  cfg.json + sae.safetensors: sparsify.Sae.load_from_disk(OUT) (topk only; the others are refused);
            a topk transcoder as transcode: true (skip_connection: true with a skip path), d_out = d_model only
  circuit-tracer  config.yaml + layer_{i}.safetensors, from --run given once per layer 0..L-1 (or once, a CLT
                  run: W_enc_{i} and W_dec_{i}.safetensors, model_kind cross_layer_transcoder), each a relu,
            jumprelu or batchtopk transcoder to mlp_out of its layer from one hook point (mlp_in or resid_mid):
            circuit_tracer.ReplacementModel.from_pretrained(MODEL, "/absolute/OUT")

saeflow's input scale (and a transcoder's target scale) is folded into the weights (W_enc * scale, W_dec / out
scale, b_dec / out scale, W_skip * scale / out scale), so the codes equal saeflow's and the output is in raw
activation space; cfg.json records the run, layer and folded scales (SAELens: metadata.saeflow; sparsify: saeflow)
and the other tool's names of the hook points read (SAELens: metadata.hook_name, hook_name_out; sparsify:
saeflow.hookpoint). OUT must not exist; it is published in one rename.
"""

IMPORT_CHECKPOINT_DESCRIPTION = """\
Turn a SAELens (cfg.json + sae_weights.safetensors) or sparsify (cfg.json + sae.safetensors) SAE directory into a
saeflow run directory ROOT/<run_id>/ (checkpoint/config.json naming the origin, the weights' sha256, the layer and the
shard directory; checkpoint/sae.pt; links/train-shards -> DIR), ready for `saeflow inference --run RUN --shards DIR`
and `saeflow visuals`. The run id is the sha256 of that config, so an import is idempotent. Architectures: SAELens
standard, topk, jumprelu (per-latent or shared thresholds; BatchTopK when its training metadata says so), gated, and
the transcoders transcoder, skip_transcoder, jumprelu_transcoder, jumprelu_skip_transcoder; sparsify topk (transcode
and skip_connection too); one layer (--layer L) of a circuit-tracer transcoder set (config.yaml +
layer_{i}.safetensors: relu or JumpReLU, skip path); a circuit-tracer cross-layer transcoder (config.yaml + W_enc_{i}
and W_dec_{i}.safetensors) as one CLT run, --shards and --target-shards once (a directory of every layer) or once per
layer. A transcoder needs --target-shards (the activation it predicts; a
sparsify SAE with a skip connection predicts its input: --shards). The checkpoint's hook names are recorded in the
config. No code from the checkpoint runs: it is read as untrusted input, refused in one line before anything is
written when cfg.json's values are mistyped (a boolean written as a string), its sizes or k disagree with the tensors,
a hook name is no hook name, a tensor is non-finite, not float16/bfloat16/float32 (float64 only when exact) or unused,
or a file is over its cap or no regular file (docs/interop.md, "Hostile checkpoints").
"""


def register(subparsers):
    p = subparsers.add_parser("export", help="prompt dataset -> text model -> lmprobe / Zarr / gzip-pickle",
                              description=EXPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", type=pathlib.Path, metavar="CONFIG", help="the workflow config (YAML)")
    p.add_argument("--export", metavar="NAME", help="which `exports` entry (optional when there is one)")
    p.add_argument("--format", choices=config.enum("export_spec", "format"), help="ad hoc: output format")
    p.add_argument("--model", help="ad hoc: HF id or local transformers directory")
    p.add_argument("--prompts", help="ad hoc: .jsonl/.csv/.parquet with a text column (label and extras optional)")
    p.add_argument("--layers", type=int, nargs="+", help="ad hoc: block indices")
    p.add_argument("--storage", choices=config.enum("export_spec", "lmprobe", "storage"),
                   help="ad hoc lmprobe: storage mode")
    p.add_argument("--top-k", type=int, help="ad hoc lmprobe: top-k logits (0 = none)")
    p.add_argument("--response-max", type=int, help="ad hoc zarr: greedy response tokens (0 = none)")
    p.add_argument("--out", type=pathlib.Path,
                   help="output directory (default: the spec's `out`, else results/exports/<name>)")
    p.add_argument("--part", type=int, action="append", metavar="I", help="zarr: write only shard store I (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)

    p = subparsers.add_parser("convert", help="convert between interop formats, or import into saev shards",
                              description=CONVERT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=pathlib.Path, metavar="SRC",
                   help="lmprobe dataset, Zarr store or root, gzip-pickle directory; for saev2.1 a shard directory")
    p.add_argument("--to", required=True, choices=SINK_FORMATS, help="output format")
    p.add_argument("out", type=pathlib.Path, metavar="OUT",
                   help="output directory (for saev and saev2.1: the shards root)")
    p.add_argument("--memory-budget", type=_positive_bytes, default=DEFAULT_MEMORY_BUDGET, metavar="BYTES",
                   help="refuse any source file that would need more memory than this to read: a gzip-pickle shard "
                        "(decompressed stream and unpickled objects), an lmprobe safetensors shard, a Zarr array "
                        f"chunk or metadata file (default {DEFAULT_MEMORY_BUDGET} = 1 GiB; sources are untrusted)")
    p.set_defaults(func=cmd_convert)

    p = subparsers.add_parser("import", help="import another tool's shard directory (saev) into the shard store",
                              description="Import shard directories written by other tools into the shard store.")
    formats = p.add_subparsers(dest="import_format", metavar="FORMAT", required=True)
    s = formats.add_parser("saev", help="a saev (OSU-NLP-Group) protocol 2.1 shard directory",
                           description=IMPORT_SAEV_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("src", type=pathlib.Path, metavar="DIR",
                   help="the saev directory (<...>/shards/<8- or 64-digit hash>)")
    s.add_argument("--shards-root", type=pathlib.Path, required=True, metavar="ROOT",
                   help="saeflow shards root: the import is published as ROOT/<sha256>/")
    s.add_argument("--allow-empty-extra-shard", action="store_true",
                   help="leave out the empty last entry saev's writer adds to shards.json when n_examples is a "
                        "multiple of the examples per shard")
    s.add_argument("--no-link-checksums", action="store_true",
                   help="do not read the linked shards to record their sha256 (fast; `validate --deep` then cannot "
                        "verify them)")
    s.add_argument("--memory-budget", type=_positive_bytes, default=DEFAULT_MEMORY_BUDGET, metavar="BYTES",
                   help="bound for reading saev's JSON files and unpickling its data field (default 1 GiB)")
    s.set_defaults(func=cmd_import_saev)
    _add_checkpoint_commands(subparsers)
    p = subparsers.add_parser(
        "export-features", help="write circuit-tracer's feature-view files from a transcoder set's inference dumps",
        description="Read each --run's inference dump on its validation shards (saeflow inference) and write "
        "OUT/features/index.json.gz (per layer: its file and every feature's byte offset) and layer_<l>.bin (per "
        "feature: a 4-byte little-endian length, then zlib-compressed JSON of its top examples, activation "
        "frequency, maximum and histogram), the files circuit-tracer's frontend reads for a feature node (named by "
        "the Cantor pair of layer and index). --run once per layer, every layer from 0 up; OUT must not exist.",
    )
    p.add_argument("--run", required=True, type=pathlib.Path, action="append", help="a run with its dump (per layer)")
    p.add_argument("--tokenizer", default=None, help="decode tokens with this tokenizer (default: the shards' model)")
    p.add_argument("out", type=pathlib.Path, metavar="OUT", help="output directory (must not exist)")
    p.set_defaults(func=cmd_export_features)


def _add_checkpoint_commands(subparsers):
    """export-checkpoint and import-checkpoint; their old spellings export-sae and import-sae (which read like
    `import saev`, a different job) still work, unlisted."""
    commands = (
        ("export-checkpoint", "export-sae", "write a run's SAE as a SAELens or sparsify checkpoint directory",
         EXPORT_CHECKPOINT_DESCRIPTION, _export_checkpoint_args, cmd_export_checkpoint),
        ("import-checkpoint", "import-sae", "make a run directory from a SAELens or sparsify SAE checkpoint",
         IMPORT_CHECKPOINT_DESCRIPTION, _import_checkpoint_args, cmd_import_checkpoint),
    )  # fmt: skip
    for name, old_name, help_text, description, add_args, func in commands:
        for command in (name, old_name):
            listed = {"help": help_text} if command == name else {}
            p = subparsers.add_parser(command, description=description,
                                      formatter_class=argparse.RawDescriptionHelpFormatter, **listed)
            add_args(p)
            p.set_defaults(func=func)


def _export_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, type=pathlib.Path, action="append",
                   help="a trained run directory (circuit-tracer: once per layer)")
    p.add_argument("--format", required=True, choices=CHECKPOINT_FORMATS, help="which library's files to write")
    p.add_argument("out", type=pathlib.Path, metavar="OUT", help="output directory (must not exist)")


def _import_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=pathlib.Path, metavar="SRC", help="the SAE directory (holding cfg.json)")
    p.add_argument("--format", choices=CHECKPOINT_FORMATS, default=None,
                   help="default: detected from the weights file name (circuit-tracer: config.yaml beside layer_0)")
    p.add_argument("--runs-root", required=True, type=pathlib.Path, help="where run directories <run_id>/ live")
    p.add_argument("--shards", required=True, type=pathlib.Path, action="append",
                   help="the shard directory the SAE will read (a circuit-tracer CLT: one of every layer, or one per "
                        "layer, repeated)")
    p.add_argument("--layer", type=int, default=None,
                   help="the stored layer the SAE reads (optional when the shards store one layer, or store the "
                        "layer the checkpoint's hook name says; a circuit-tracer set: which layer's file, needed)")
    p.add_argument("--target-shards", type=pathlib.Path, default=None, action="append",
                   help="a transcoder's: the shard directory of the activation it predicts, paired with --shards (a "
                        "CLT's: as --shards)")


def _positive_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of bytes")
    return value


def _adhoc_spec(args) -> dict:
    missing = [flag for flag, value in (("--format", args.format), ("--model", args.model),
                                        ("--prompts", args.prompts), ("--layers", args.layers)) if value is None]
    if missing:
        from saeflow.errors import SaeflowError

        raise SaeflowError("give CONFIG (and --export NAME), or all of --format --model --prompts --layers; "
                           f"missing {missing}")
    spec = {"format": args.format, "model": {"name": args.model}, "prompts": {"path": args.prompts},
            "layers": args.layers}
    lm = {k: v for k, v in (("storage", args.storage), ("top_k", args.top_k)) if v is not None}
    if lm:
        spec["lmprobe"] = lm
    if args.response_max is not None:
        spec["zarr"] = {"response_max": args.response_max}
    return spec


def cmd_export(args: argparse.Namespace) -> int:
    from saeflow.interop import convert
    from saeflow.interop.spec import ExportSpec

    if args.config is not None:
        name, spec = config.pick(config.load(args.config)["exports"], args.export, "export")
    else:
        name, spec = "adhoc", _adhoc_spec(args)
    spec = ExportSpec.from_dict(spec)
    out = args.out or pathlib.Path(spec.out_dpath(name))
    path = convert.export(spec, out, parts=args.part, progress=not args.no_progress)
    print(path)
    return 0


def cmd_import_saev(args: argparse.Namespace) -> int:
    from saeflow.interop import saev_import

    dpath, _ = saev_import.import_saev(args.src, args.shards_root, args.memory_budget, args.allow_empty_extra_shard,
                                       link_checksums=not args.no_link_checksums)
    print(dpath)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from saeflow.interop import convert

    print(convert.convert(args.src, args.to, args.out, args.memory_budget))
    return 0


def cmd_export_checkpoint(args: argparse.Namespace) -> int:
    from saeflow.errors import SaeflowError
    from saeflow.interop.checkpoints import circuit_tracer, circuit_tracer_clt, sae_checkpoints

    if args.format == CIRCUIT_TRACER and len(args.run) == 1 and circuit_tracer_clt.is_clt_run(args.run[0]):
        print(circuit_tracer_clt.export_clt(args.run[0], args.out))  # one cross-layer transcoder
    elif args.format == CIRCUIT_TRACER:
        print(circuit_tracer.export_transcoder_set(args.run, args.out))
    elif len(args.run) != 1:
        raise SaeflowError(f"--format {args.format} writes one run; got --run {len(args.run)} times")
    else:
        print(sae_checkpoints.export_run(args.run[0], args.format, args.out))
    return 0


def cmd_export_features(args: argparse.Namespace) -> int:
    from saeflow.analysis import feature_files

    print(feature_files.export_features(args.run, args.out, args.tokenizer))
    return 0


def cmd_import_checkpoint(args: argparse.Namespace) -> int:
    from saeflow.errors import SaeflowError
    from saeflow.interop.checkpoints import circuit_tracer_clt, sae_checkpoints

    if args.format in (None, CIRCUIT_TRACER) and circuit_tracer_clt.is_clt_dir(args.src):  # a CLT: every layer
        print(circuit_tracer_clt.import_clt(args.src, args.runs_root, args.shards, args.target_shards).root)
        return 0
    for flag, given in (("--shards", args.shards), ("--target-shards", args.target_shards or [None])):
        if len(given) != 1:
            raise SaeflowError(f"{flag} given {len(given)} times; an SAE or a transcoder reads one directory")
    run = sae_checkpoints.import_checkpoint(args.src, args.runs_root, args.shards[0], layer=args.layer,
                                           fmt=args.format, target_shards=(args.target_shards or [None])[0])
    print(run.root)
    return 0
