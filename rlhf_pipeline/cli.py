"""The `rlhf` command: one parser assembled from the command groups (:mod:`rlhf_pipeline.commands`), and
:func:`main`, which runs one command with its output redacted and its errors as exit codes."""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: the rlhf command runs offline and quiet)

import argparse
import gc
import os
import signal
import sys

from rlhf_pipeline import __version__
from rlhf_pipeline.commands import data, label, lineage, models, project
from rlhf_pipeline.errors import PipelineError, quoted
from rlhf_pipeline.redaction import RedactingStream
from rlhf_pipeline.runner import report_error, report_unexpected


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors show what the user typed cut and escaped (a 100 kB
    argument or a control character would otherwise be echoed whole)."""

    def error(self, message: str):
        super().error(message if len(message) <= 300 and message.isprintable() else quoted(message, 300))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rlhf", description="RLHF-with-PPO pipeline tools (the stages run through `dvc repro`).")
    parser.add_argument("--version", action="version", version=f"rlhf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # in the order `rlhf --help` lists them
    project.add_parsers(sub)
    models.add_parser(sub)
    data.add_parsers(sub)
    lineage.add_parser(sub)
    data.add_export_parser(sub)
    label.add_parser(sub)
    project.add_plots_page_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    # A command imports what it needs when it runs (torch, transformers, DVC, GTO, Great Expectations):
    # hundreds of thousands of objects that live until the process ends. With the collector on, those
    # imports set off hundreds of collections that walk them, and the interpreter's last collection at
    # exit walks them once more. So an `rlhf` process (argv from its own command line; a test or a
    # bench calling main with arguments keeps its collector as it is) runs its command with the
    # collector off, and freezes what it holds before the exit: `rlhf check-params` with a built
    # models/base takes about a third less time (bench/results/process_start.md). Nothing piles up
    # meanwhile: the longest command, `rlhf label export` on the default policy, leaves about 19,100
    # unreachable objects whether it samples 16 or 160 queries (most of them made by its imports), and
    # peaks at the same memory as with the collector on.
    own_process = argv is None
    if own_process:
        gc.disable()
    # everything the command prints (its messages, a traceback, a library's warning) passes through the
    # one redaction home first: no token, password or exchanged access token reaches the terminal or a log
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    try:
        args = build_parser().parse_args(argv)
        try:
            code = args.func(args)
            sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        except BrokenPipeError:  # `rlhf lineage ... | head -1`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            code = 128 + signal.SIGPIPE
        except PipelineError as error:
            code = report_error(error, f"rlhf {args.command}")
        except Exception as error:
            code = report_unexpected(error, f"rlhf {args.command}")
    finally:
        sys.stdout, sys.stderr = streams
    if own_process:
        gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    main()
