"""The `draftline` command. Each subcommand lives in its own module, imported only when used
(torch, transformers and GX are slow to import), and defines `add_arguments` and `run`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compose": ("draftline.commands.compose", "compose conf/ into params.yaml (Hydra overrides)"),
    "doctor": ("draftline.commands.doctor", "check this node: tools, packages, GPUs, profile"),
    "plan": ("draftline.commands.plan", "time, storage and cost of a run on each profile"),
    "serve": ("draftline.commands.serve", "start, stop or show the SGLang servers"),
    "salvage": ("draftline.commands.salvage", "save everything before a node shuts down"),
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
    parser = argparse.ArgumentParser(prog="draftline", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        top.parse_args(argv)  # prints help or the unknown-command error and exits
        return 2
    name, rest = argv[0], argv[1:]
    if COMMANDS[name][0].startswith("draftline.stages.") and "DVC_STAGE" in os.environ:
        from draftline import stage_inputs

        stage_inputs.check_from_env()  # before the stage reads anything (--allow-missing)
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"draftline {name}", description=module.__doc__)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    result = module.run(args)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
