"""`saeflow validate`, `saeflow info` and `saeflow compare`: check, describe and compare results."""

import argparse
import dataclasses
import json
import pathlib

from saeflow.errors import SaeflowError
from saeflow.extraction import hooks
from saeflow.store import compare, shards


def register(subparsers):
    p = subparsers.add_parser(
        "validate",
        help="check a shard directory (exit 0 when valid)",
        description="Check a saev protocol 2.0 shard directory: metadata.json parses and hashes to the directory "
        "name, shards.json matches the sizing maths, every shard and side file is a regular file this user can "
        "read, of its exact size. All problems are listed at once on stdout, each with its path; the exit code is 1 "
        "and stderr holds one line naming the first. Stray files are reported as warnings only.",
    )
    p.add_argument("dpath", type=pathlib.Path, metavar="DIR", help="the shard directory <shards_root>/<hash>")
    p.add_argument("--deep", action="store_true", help="also verify every file's sha256 against checksums.json")
    p.set_defaults(func=cmd_validate)

    p = subparsers.add_parser(
        "info",
        help="summarize a shard directory",
        description="Print what a shard directory holds (model, layers, shapes, sizes, provenance).",
    )
    p.add_argument("dpath", type=pathlib.Path, metavar="DIR", help="the shard directory <shards_root>/<hash>")
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_info)

    p = subparsers.add_parser(
        "compare",
        help="compare two results of one hash made on different machines (exit 0 within tolerance)",
        description="Compare two shard directories of the same metadata hash, or two runs of the same run id, made "
        "on different platforms (other CPU instruction sets, GPUs or torch builds round floats differently: the "
        "README's reproducibility statement). Shards: per layer, the largest absolute difference and the largest "
        "relative difference of a vector, ||a - b|| / ||a||; integer side files must be identical. Runs: per tensor "
        "of sae.pt, the largest absolute and the relative difference ||a - b|| / ||a||, and the validation metrics "
        "side by side. Exit 0 when every relative difference is within --tol, 1 otherwise.",
    )
    p.add_argument("a_path", type=pathlib.Path, metavar="A", help="a shard directory or a run directory")
    p.add_argument("b_path", type=pathlib.Path, metavar="B", help="the same kind, of the same hash")
    p.add_argument(
        "--tol", type=float, default=None,
        help=f"relative tolerance (default: shards {compare.FLOAT32_TOL:g} for float32, 4 steps of float16 for "
        f"float16; runs {compare.RUN_TOL:g}, as training amplifies rounding)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_compare)


def cmd_validate(args: argparse.Namespace) -> int:
    report = shards.validate(args.dpath, deep=args.deep)
    for warning in report.warnings:
        print(f"warning: {warning}")
    if report.ok:
        print(f"ok: {args.dpath} is a valid shard directory" + (" (checksums verified)" if args.deep else ""))
        return 0
    print(f"invalid: {args.dpath}")
    for problem in report.problems:
        print(f"  - {problem}")
    more = f" (and {len(report.problems) - 1} more, listed above)" if len(report.problems) > 1 else ""
    raise SaeflowError(f"invalid shard directory {args.dpath}: {report.problems[0]}{more}")


def cmd_info(args: argparse.Namespace) -> int:
    sd = shards.ShardDir(args.dpath)
    md = sd.metadata
    summary = {
        "path": str(sd.dpath.resolve()),
        "hash": sd.hash,
        "metadata": md.to_dict(),
        "hook_point": hooks.stored(md.data),
        "tokens_per_ex": md.tokens_per_ex,
        "ex_per_shard": md.ex_per_shard,
        "n_shards": len(sd.shard_sizes),
        "n_vectors_per_layer": md.n_ex * md.tokens_per_ex,
        "n_bytes": md.n_bytes,
        "side_files": [f for f in shards.AUX_FILES if sd.has_aux(f)],
        "provenance": sd.provenance(),
    }
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    prov = summary["provenance"] or {}
    print(f"{summary['path']}")
    print(f"  model        {md.family} {md.ckpt}")
    print(f"  dataset      {md.dataset} ({md.data.get('__class__')})")
    print(f"  layers       {list(md.layers)} ({summary['hook_point']})")
    print(f"  examples     {md.n_ex} x {md.tokens_per_ex} tokens "
          f"({'CLS + ' if md.cls_token else ''}{md.patches_per_ex} patches)")
    print(f"  d_model      {md.d_model} ({md.dtype})")
    print(f"  shards       {summary['n_shards']} x up to {md.ex_per_shard} examples, {md.n_bytes / 2**30:.3f} GiB")
    print(f"  side files   {', '.join(summary['side_files']) or 'none'}")
    if prov:
        print(f"  made         {prov.get('finished_at')} on {prov.get('host')} "
              f"by saeflow {prov.get('saeflow_version')}")
        platform = prov.get("platform") or {}
        if platform:
            device = platform.get("gpu") or f"{platform.get('cpu_model')} ({platform.get('cpu_capability')} kernels)"
            mixed = ", parts on mixed platforms" if prov.get("mixed_platforms") else ""
            print(f"  platform     {device}, torch {platform.get('torch_version')}, {platform.get('numerics')} "
                  f"numerics{mixed}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    if args.tol is not None and not args.tol >= 0:
        raise SaeflowError(f"--tol {args.tol}: must be a non-negative number")
    from saeflow.training.sae import sae_tensors  # torch, imported when the command runs

    report = compare.compare(args.a_path, args.b_path, args.tol, sae_tensors)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"ok": report.ok}, indent=2))
    else:
        print(compare.format_report(report, args.a_path, args.b_path))
    return 0 if report.ok else 1
