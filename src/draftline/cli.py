"""The `draftline` command. Each subcommand lives in its own module, imported only when used
(torch, transformers and GX are slow to import), and defines `add_arguments` and `run`."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

# What `draftline --help` says: for users, in the order a run uses the commands.
DESCRIPTION = """Train a DFlash drafter for a target model: compose the configuration, check the
node, plan the run, serve the target, then `dvc repro` runs the stages (curate, generate,
validate, extract, train, evaluate). `draftline COMMAND --help` explains each command.

  draftline compose hardware=b200x8 model=qwen3_6_27b data=sharegpt drafter=dflash_b16
  draftline doctor                 # is this node ready for params.yaml?
  draftline plan                   # time, storage, cost and memory per profile
  draftline serve start            # the profile's SGLang servers
  dvc repro                        # every stage; results in reports/, `dvc exp show`
  draftline salvage                # save everything before the node shuts down
  draftline lead / draftline follow   # two nodes: one generates, the other trains meanwhile"""

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compose": ("draftline.commands.compose", "compose conf/ into params.yaml (Hydra overrides)"),
    "doctor": ("draftline.commands.doctor", "check this node: tools, packages, GPUs, profile"),
    "plan": ("draftline.commands.plan", "time, storage and cost of a run on each profile"),
    "calibrate": (
        "draftline.commands.calibrate",
        "measure this node's generate/extract/train rates for plan",
    ),
    "serve": ("draftline.commands.serve", "start, stop or show the SGLang servers"),
    "bench": ("draftline.commands.bench", "acceptance and speed-up against a live SGLang server"),
    "salvage": ("draftline.commands.salvage", "save everything before a node shuts down"),
    "lead": ("draftline.commands.lead", "generating node: run and push each shard as it finishes"),
    "follow": ("draftline.commands.follow", "training node: train on each shard as it arrives"),
    "build-tiny-target": (
        "draftline.commands.build_tiny_target",
        "rebuild the embedded tiny target model",
    ),
    "build-sample": ("draftline.commands.build_sample", "rebuild the bundled prompt set"),
    # Stage entry points called by dvc.yaml.
    "curate": ("draftline.stages.curate", "stage: curate raw conversations"),
    "generate": ("draftline.stages.generate", "stage: regenerate one shard with the target"),
    "validate": ("draftline.stages.validate", "stage: validate generated data (GX)"),
    "extract": ("draftline.stages.extract", "stage: token packs and target features"),
    "train": ("draftline.stages.train", "stage: train the DFlash drafter"),
    "evaluate": ("draftline.stages.evaluate", "stage: offline acceptance length tau"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftline",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--verbose", action="store_true", help="full traceback on errors (anywhere on the line)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def short_error(err: Exception) -> str | None:
    """One line naming the fix for a user's mistake (configuration, paths); None for a bug."""
    from hydra.errors import HydraException

    from draftline.runtime.params import hydra_message

    if isinstance(err, HydraException):
        return hydra_message(str(err))
    if full := disk_full(err):
        return full
    if not isinstance(err, OSError):
        return None
    if "huggingface" in str(err).lower():  # transformers could not load model.path
        first = str(err).strip().splitlines()[0].rstrip(".")
        return f"{first}; check model.path: a model folder here, or a hub id this node can download"
    if not err.filename:
        return None  # a socket or other OS error, not a path the user gave: keep the traceback
    if isinstance(err, PermissionError) or err.errno == errno.EROFS:
        fix = "choose a folder you can write to (--out/--output) or fix its permissions"
    elif isinstance(err, (FileNotFoundError, FileExistsError, NotADirectoryError)):
        fix = "check the path: each folder on it must exist and be a folder"
    else:
        fix = "check the path and the disk"
    return f"{err.filename}: {err.strerror}; {fix}"


# A write the disk or the shell refused: out of space (ENOSPC), over quota (EDQUOT), or over
# the file-size limit (EFBIG: `ulimit -f`; Python ignores SIGXFSZ, so the write fails instead).
# pyarrow and safetensors carry the OS's words; torch.save only says its stream failed.
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
FULL_WORDS = ("no space left on device", "disk quota exceeded")
LIMIT_WORDS = ("file too large",)
STREAM_WORDS = ("basic_ios::clear: iostream error", "pytorchstreamwriter failed writing")
FREE = "free space (`df -h .`; `draftline plan` gives each stage's size) and rerun"
RAISE_LIMIT = "raise the shell's file-size limit (`ulimit -f unlimited`) and rerun"


def disk_full(err: BaseException) -> str | None:
    """One line for a write that failed for want of space, wherever it was raised (an OSError,
    or pyarrow's, safetensors' or torch's error around one); None for anything else."""
    seen: BaseException | None = err
    while seen is not None:
        text = str(seen).lower()
        code = getattr(seen, "errno", None) if isinstance(seen, OSError) else None
        where = f" writing {seen.filename}" if getattr(seen, "filename", None) else ""
        if code in FULL_ERRNOS or any(w in text for w in FULL_WORDS):
            return f"a write failed{where}: the disk is full; {FREE}"
        if code == errno.EFBIG or any(w in text for w in LIMIT_WORDS):
            return f"a write failed{where}: over the file-size limit (`ulimit -f`); {RAISE_LIMIT}"
        if any(w in text for w in STREAM_WORDS):
            return (
                "a write failed: the disk is full or a file-size limit (`ulimit -f`) applies; "
                f"{FREE}, or {RAISE_LIMIT.removesuffix(' and rerun')}"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv
    argv = [a for a in argv if a != "--verbose"]
    top = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        top.parse_args(argv)  # prints help or the unknown-command error and exits
        return 2
    name, rest = argv[0], argv[1:]
    if COMMANDS[name][0].startswith("draftline.stages.") and "DVC_STAGE" in os.environ:
        from draftline.runtime import stage_inputs

        stage_inputs.check_from_env()  # before the stage reads anything (--allow-missing)
    module = importlib.import_module(COMMANDS[name][0])
    # The module docstrings are written as they should print: examples one per line.
    parser = argparse.ArgumentParser(
        prog=f"draftline {name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        result = module.run(args)
    except Exception as err:
        message = None if verbose else short_error(err)
        if message is None:
            raise
        print(f"draftline {name}: {message} (--verbose for the traceback)", file=sys.stderr)
        return 1
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
