"""`rlhf validate-preferences` and `rlhf export-preferences`: a preference file against the data contract, and
the preference data in TRL's pairwise format."""

from __future__ import annotations

from rlhf_pipeline import paths
from rlhf_pipeline.commands.base import (
    command,
    never_over_inputs,
    params_if_there,
    refuse_owned,
    writing,
)
from rlhf_pipeline.datadocs import check_docs_folder


def cmd_validate_preferences(args) -> int:
    from rlhf_pipeline.contract import validate_file_cli  # loads Great Expectations: only when this command runs

    never_over_inputs(args.result, args.path)
    for output, option in ((args.result, "--result"), (args.docs, "--docs")):
        refuse_owned(output, option, params_if_there(args.params))
    if args.docs:
        check_docs_folder(args.docs)  # before the contract runs, not after it has printed its verdict
    with writing(args.result or args.docs or "the result"):
        return validate_file_cli(args.path, params_path=args.params, result_path=args.result, docs_dir=args.docs)


def cmd_export_preferences(args) -> int:
    # loads torch and datasets: only when this command runs
    from rlhf_pipeline.preferences.export import export_pairwise

    never_over_inputs(args.output, args.input)
    refuse_owned(args.output, "OUTPUT", params_if_there("params.yaml"))
    with writing(args.output):
        count = export_pairwise(args.input, args.split, args.output)
    print(f"{args.output}: {count} pairs (prompt, chosen, rejected) from {args.input} [{args.split}]")
    return 0


def add_parsers(sub) -> None:
    """``rlhf validate-preferences`` and ``rlhf export-preferences``."""
    p = command(
        sub,
        "validate-preferences",
        "run the Great Expectations contract on a preference file (either format)",
        "rlhf validate-preferences data/labels/human.jsonl --docs /tmp/docs",
    )
    p.add_argument("path")
    p.add_argument(
        "--params", default="params.yaml", help="bounds come from data.validation here (defaults if missing)"
    )
    p.add_argument("--result", default=None, help="also write the GX JSON result here")
    p.add_argument("--docs", default=None, help="also write Great Expectations Data Docs (offline HTML) to this folder")
    p.set_defaults(func=cmd_validate_preferences)


def add_export_parser(sub) -> None:
    """``rlhf export-preferences``."""
    p = command(
        sub,
        "export-preferences",
        "write the preference data in TRL's pairwise format (prompt, chosen, rejected), .jsonl or .parquet",
        "rlhf export-preferences pairs.parquet --split test",
    )
    p.add_argument("output")
    p.add_argument("--input", default=paths.PREFERENCES, help="the preferences stage's output")
    p.add_argument("--split", default="train", choices=["train", "test"])
    p.set_defaults(func=cmd_export_preferences)
