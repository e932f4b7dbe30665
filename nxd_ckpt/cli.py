"""The ``nxd-ckpt`` command: ls, info, verify, convert-zero1, export, import, reshard, to-dcp, from-dcp.

``main(argv)`` returns the exit code: 0 success, 1 a failure (damaged checkpoint, bad input; the message is
printed as ``nxd-ckpt: error: ...``), 2 a usage error. Works on CPU without torch-xla or a process group.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ._version import __version__

PROG = "nxd-ckpt"

_MAIN_EPILOG = """examples:
  nxd-ckpt ls ckpts/                       list tags, newest first, with status and topology
  nxd-ckpt info ckpts/step_1000 --tensors  what one tag holds
  nxd-ckpt verify ckpts/                   re-read every file against its checksum
  nxd-ckpt convert-zero1 --input_dir ckpts/step_1000 --output_dir ckpts/step_1000_dp4 \\
      --convert_to_sharded --dp_size 4      change the DP size of a ZeRO-1 optimizer state
  nxd-ckpt export ckpts/step_1000 --output hf_model --dtype bf16
                                           merge TP/PP shards into Hugging Face safetensors
  nxd-ckpt import hf_model ckpts/imported --tp 8 --preset llama
                                           Hugging Face safetensors -> a tag at any TP/PP
  nxd-ckpt reshard ckpts/step_1000 ckpts/step_1000_tp4 --tp 4 --dp 2
                                           a tag at new TP/PP/DP sizes
  nxd-ckpt to-dcp ckpts/step_1000 dcp/step_1000
                                           a tag -> torch.distributed.checkpoint (native PyTorch)
  nxd-ckpt from-dcp dcp/step_1000 ckpts/step_1000 --tp 2 --dp 2 --zero1
                                           torch.distributed.checkpoint -> a tag

`nxd-ckpt COMMAND --help` describes each command."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*a, **kw)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from . import export, zero1

    parser = _Parser(
        prog=prog,
        description="Inspect, verify, reshard and export nxd-ckpt / neuronx-distributed checkpoints.",
        epilog=_MAIN_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"nxd-ckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)

    p = sub.add_parser("ls", help="list the checkpoint tags of a directory",
                       description="List the tags of a checkpoint directory, newest first, with a quick status "
                                   "(complete / incomplete / damaged: a file missing or of the wrong size; "
                                   "checksums are `verify`'s job), size, write time and topology.",
                       epilog="example:\n  nxd-ckpt ls ckpts/\n  nxd-ckpt ls ckpts/ --json | jq '.[0].tag'")
    p.add_argument("dir", metavar="DIR", help="the checkpoint directory (holding tag directories)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("info", help="describe one tag",
                       description="Describe one tag: topology, shards with file counts and bytes, tensor counts "
                                   "by dtype, scheduler and user-content keys; with --tensors every tensor.",
                       epilog="example:\n  nxd-ckpt info ckpts/step_1000\n  nxd-ckpt info ckpts/step_1000 --tensors --json")
    p.add_argument("tag", metavar="DIR/TAG", help="the tag directory")
    p.add_argument("--tensors", action="store_true", help="list every tensor (name, shape, dtype, shard)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--trusted", action="store_true",
                   help="unpickle without weights_only restrictions (only for checkpoints from a trusted source)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("verify", help="check every file of a tag (or of every tag) against its checksum",
                       description="Verify tags. With a manifest (nxd-ckpt): every file's size and CRC32C. Without "
                                   "(neuronx-distributed): the `done` marker, every file named by the ref files, and "
                                   "that every tensor file opens. Exit 0 when everything is intact, 1 when anything "
                                   "is damaged or incomplete.",
                       epilog="example:\n  nxd-ckpt verify ckpts/             every tag\n"
                              "  nxd-ckpt verify ckpts/step_1000 --workers 16 --json")
    p.add_argument("path", metavar="DIR|DIR/TAG", help="a checkpoint directory, or one tag directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="reader threads (default 8)")
    p.add_argument("--nxd", action="store_true",
                   help="check tags without a manifest by neuronx-distributed's rules even in a directory "
                        "managed by nxd-ckpt (where a missing manifest is otherwise reported)")
    p.add_argument("--trusted", action="store_true",
                   help="unpickle ref files without weights_only restrictions (trusted sources only)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("convert-zero1", help="change the DP size of a ZeRO-1 optimizer checkpoint",
                       description="Re-shard the ZeRO-1 optimizer state of a tag to a new data-parallel size (or "
                                   "merge it into full files) into a new complete tag. Takes neuronx-distributed's "
                                   "converter flags; keeps sharded_master_weights; never modifies the input.",
                       epilog=zero1.EPILOG)
    zero1.add_arguments(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("export", help="merge the model's TP/PP shards into Hugging Face safetensors",
                       description="Merge the model's tensor-parallel shards (with the partition attributes "
                                   "recorded at save time, or --partition) and pipeline stages into full tensors, "
                                   "written as model-0000k-of-0000N.safetensors + model.safetensors.index.json "
                                   "(or one model.safetensors).",
                       epilog=export.EPILOG)
    export.add_arguments(p)
    p.set_defaults(func=_cmd_export)

    from . import convert

    helps = {"import": ("turn Hugging Face safetensors into a tag at given TP/PP sizes",
                        "Split a Hugging Face checkpoint (one model.safetensors, or shards with their index) into a "
                        "complete tag at --tp/--pp, with partition dims from --partition rules or --preset llama."),
             "reshard": ("write a tag at new TP/PP/DP sizes",
                         "Join every tensor (model, optimizer moments, master weights) by its recorded partition "
                         "attributes and split it again at --tp/--pp/--dp, one tensor at a time, into a new "
                         "complete tag that loads at the new sizes."),
             "to-dcp": ("convert a tag to a torch.distributed.checkpoint for native PyTorch",
                        "Write the full model, the optimizer state as torch.optim.AdamW keys it by parameter name, "
                        "scheduler and user content as a DCP checkpoint (.metadata + .distcp) that dcp.load + "
                        "set_state_dict (or TorchTitan, --layout torchtitan) resume from."),
             "from-dcp": ("convert a torch.distributed.checkpoint into a tag",
                          "Bring a DCP checkpoint (written by to-dcp, or by a PyTorch job with get_state_dict / "
                          "TorchTitan) back into a tag at --tp/--pp/--dp [--zero1].")}
    for name, (add, _run_fn) in convert.COMMANDS.items():
        short, desc = helps[name]
        p = sub.add_parser(name, help=short, description=desc, epilog=convert.EPILOGS[name])
        add(p)
        p.set_defaults(func=_cmd_convert_state, convert_fn=_run_fn)
    return parser


# --- commands -----------------------------------------------------------------------------------------
def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _emit(args, doc, render) -> int:
    """Print ``doc`` as JSON (``--json``) or as ``render(doc)``; exit code 0."""
    if getattr(args, "json", False):
        _print_json(doc)
    else:
        print(render(doc))
    return 0


def _cmd_ls(args) -> int:
    from .inspect import format_list, list_tags

    return _emit(args, list_tags(args.dir), format_list)


def _cmd_info(args) -> int:
    from .inspect import describe, format_describe

    return _emit(args, describe(args.tag, tensors=args.tensors, trusted=args.trusted), format_describe)


def _cmd_verify(args) -> int:
    from .errors import CheckpointArgumentError
    from .inspect import format_bytes
    from .storage import open_storage
    from .verify import is_tag_dir, verify_dir, verify_tag

    if args.workers < 1:
        raise CheckpointArgumentError(f"--workers must be >= 1, got {args.workers}")
    path = args.path
    storage = open_storage(path)
    if not storage.isdir(""):
        raise CheckpointArgumentError(f"{path} is not a directory; pass a checkpoint directory or DIR/TAG")
    kw = {"require_manifest": False if args.nxd else None, "trusted": args.trusted}
    if is_tag_dir(storage):
        results = [verify_tag(storage, args.workers, **kw)]
    else:
        results = verify_dir(storage, args.workers, **kw)
        if not results:
            raise CheckpointArgumentError(f"{path} holds no checkpoint tags; pass a checkpoint directory or DIR/TAG")
    ok = all(r.ok for r in results)
    if args.json:
        _print_json({"ok": ok, "tags": [r.to_json() for r in results]})
    else:
        for r in results:
            incomplete = any(f in ("done", "manifest.json") and w.startswith("missing") for f, w in r.problems)
            state = "OK" if r.ok else ("INCOMPLETE" if incomplete else "DAMAGED")
            print(f"{state:<10} {r.tag}  ({r.kind}: {r.files_checked} files, "
                  f"{format_bytes(r.bytes_checked)} checked)")
            for f, what in r.problems:
                print(f"  {r.path}/{f if f != '.' else ''}".rstrip("/") + f": {what}")
            for note in r.notes:
                print(f"  note: {note}")
        bad = sum(not r.ok for r in results)
        if len(results) > 1:
            print(f"{len(results) - bad} of {len(results)} tags intact" + (f", {bad} damaged or incomplete" if bad else ""))
    return 0 if ok else 1


def _cmd_convert(args) -> int:
    from .inspect import format_bytes
    from .zero1 import run_from_args

    res = run_from_args(args)
    if getattr(args, "json", False):
        _print_json(res.to_json())
    else:
        to = "full files" if res.output_dp is None else f"DP={res.output_dp}"
        frm = "full files" if res.input_dp is None else f"DP={res.input_dp}"
        extra = f"; {res.linked} files hard-linked, {res.copied} copied" if (res.linked or res.copied) else ""
        print(f"converted {res.params} parameters in {res.groups} (tp, pp) group(s) from {frm} to {to}: "
              f"{res.files_written} files, {format_bytes(res.bytes_written)} -> {res.output_dir}{extra}")
    return 0


def _cmd_export(args) -> int:
    from .export import run_from_args
    from .inspect import format_bytes

    res = run_from_args(args)
    if args.json:
        _print_json(res.to_json())
    else:
        print(f"exported {res.tensors} tensors ({format_bytes(res.total_size)}) to {res.output}: "
              f"{', '.join(res.files) if len(res.files) <= 4 else f'{len(res.files)} files'}")
        if res.skipped:
            print(f"  skipped non-tensor entries: {', '.join(res.skipped)}")
    return 0


def _cmd_convert_state(args) -> int:
    from .inspect import format_bytes

    res = args.convert_fn(args)
    if args.json:
        _print_json(res.to_json())
    else:
        d = res.detail
        what = (f"TP={d['tp']} PP={d['pp']} DP={d['dp']}" + (" ZeRO-1" if d.get("zero1") else "")) if "tp" in d \
            else f"DCP ({d['layout']} layout{', with optimizer' if d['optimizer'] else ', model only'})"
        print(f"{res.command}: {d['tensors']} tensors, {format_bytes(d['bytes_written'])} -> {res.output} "
              f"as {what} in {res.seconds:.1f}s")
    return 0


#: every command's arguments that name a file or directory (each is checked by storage.check_location)
_PATH_ARGS = ("dir", "tag", "path", "input_dir", "output_dir", "output", "src", "dst", "hf_dir")


# --- entry points ---------------------------------------------------------------------------------------
def _run(parser: argparse.ArgumentParser, argv: Optional[List[str]], prog: str) -> int:
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return _call(args.func, args, prog)


def _call(func, args, prog: str) -> int:
    import xser

    from .errors import CheckpointError
    from .storage import check_location

    try:
        for name in _PATH_ARGS:   # every one takes a POSIX path or an s3:// URL
            if isinstance(getattr(args, name, None), str):
                check_location(getattr(args, name))
        return func(args)
    except (CheckpointError, xser.XserError, OSError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: Optional[List[str]] = None) -> int:
    return _run(build_parser(), argv, PROG)


def convert_zero1_main(argv: Optional[List[str]] = None) -> int:
    """``nxd_convert_zero_checkpoints``: NxD's converter command line (same flags), safe and complete."""
    from . import zero1

    prog = "nxd_convert_zero_checkpoints"
    parser = _Parser(prog=prog, description="Change the data-parallel size of a ZeRO-1 optimizer checkpoint "
                                            "(drop-in for neuronx-distributed's converter).", epilog=zero1.EPILOG)
    zero1.add_arguments(parser)
    parser.set_defaults(func=_cmd_convert)
    return _run(parser, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
