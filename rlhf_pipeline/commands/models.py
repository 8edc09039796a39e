"""`rlhf models`: the model registry: list (:mod:`rlhf_pipeline.registry_listing`), gate
(:mod:`rlhf_pipeline.gate`), assign (:mod:`rlhf_pipeline.registry`), get (:mod:`rlhf_pipeline.fetching`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf_pipeline.commands.base import (
    command,
    project_of,
    writing,
)
from rlhf_pipeline.errors import PipelineError


def cmd_models(args) -> int:
    """The registry: list the versions, run the promotion gate, assign a stage, fetch a version."""
    import json

    root = project_of(args.root, "models")
    if args.action == "gate":
        from rlhf_pipeline.gate import gate  # loads GTO (and, to score, torch): only when the gate runs

        result = gate(root, args.params)
        print(json.dumps(result, indent=2, default=str) if args.json else result["markdown"] or result["outcome"])
        return 0
    if args.action == "assign":
        from rlhf_pipeline.registry import assign  # loads GTO: only when a stage is assigned

        if not args.name or not args.version:
            raise PipelineError("rlhf models assign NAME VERSION [--stage STAGE]: name the artifact and the version.")
        message = f"assigned {args.stage} by hand (rlhf models assign)"
        version = assign(Path(root).resolve(), args.name, args.version, args.stage, message=message)
        print(f"{args.name}@{version.version} is now {args.stage} (commit {version.commit[:12]})")
        return 0
    if args.action == "get":
        from rlhf_pipeline.fetching import fetch  # loads DVC and GTO: only when a version is fetched

        if not args.name or not args.out:
            raise PipelineError(
                "rlhf models get NAME [VERSION | --from-stage STAGE] -o DIR: name the artifact and DIR."
            )
        with writing(args.out):
            with_results = False if args.as_recorded else (True if args.with_results else None)
            got = fetch(root, args.name, args.version, args.stage_filter, args.out, with_results)
        print(f"{got['out']}: {got['artifact']}@{got['version']} ({got['files_checked']} files match its SHA256SUMS)")
        if got["results"]:
            print(f"{got['out']}/README.md: the card holds the version's held-out results (also as its model-index)")
        return 0
    from rlhf_pipeline.registry_listing import listing, render_listing  # loads GTO: only when listing

    rows = listing(root)
    print(json.dumps(rows, indent=2, default=str) if args.json else render_listing(rows))
    return 0


def add_parser(sub) -> None:
    p = command(
        sub,
        "models",
        "the model registry (GTO tags): list versions with metrics, the promotion gate, assign a stage, fetch",
        "rlhf models",
        "rlhf models gate",
        "rlhf models assign policy v1",
        "rlhf models get policy --from-stage prod -o prod-policy",
    )
    root_help = "the project, a git + DVC repository (default: the one holding the working directory)"
    p.add_argument("--root", default=None, help=root_help)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(
        func=cmd_models, action="list", name=None, version=None, stage="prod", params="params.yaml",
        stage_filter=None, out=None, with_results=False, as_recorded=False,
    )  # fmt: skip
    actions = p.add_subparsers(dest="action", metavar="{list,gate,assign,get}")

    def action(name: str, summary: str, *examples: str) -> argparse.ArgumentParser:
        q = command(actions, name, summary, *examples)
        # also after the action; SUPPRESS: given only before it, the group's value stands
        q.add_argument("--root", default=argparse.SUPPRESS, help=root_help)
        q.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
        return q

    action("list", "every registered version with its stage, date and metrics (the default)", "rlhf models list --json")
    q = action(
        "gate",
        "register HEAD's policy (and reward model) and promote it to prod if the rule in promotion.* holds",
        "rlhf models gate",
        "rlhf models gate --json --params params.yaml",
    )
    q.add_argument("--params", default="params.yaml", help="the rule is promotion.* here (a path in the project)")
    q = action(
        "assign",
        "give a registered version a stage (prod by default): a promotion by hand, or a rollback",
        "rlhf models assign policy v1",
        "rlhf models assign policy v2 --stage staging",
    )
    q.add_argument("name", help="the artifact (policy, reward-model)")
    q.add_argument("version", help="the version (v2 or v2.0.0)")
    q.add_argument("--stage", default="prod", help="the stage to give (default prod)")
    q = action(
        "get",
        "fetch a version's exact bytes (DVC's cache or remote at its commit), checked against its SHA256SUMS",
        "rlhf models get policy v2 -o policy-v2",
        "rlhf models get policy --from-stage prod -o prod-policy",
        "rlhf models get policy v2 --with-results -o publish",
    )
    q.add_argument("name", help="the artifact (policy, reward-model)")
    q.add_argument("version", nargs="?", default=None, help="the version (v2 or v2.0.0; default: the latest)")
    q.add_argument("--from-stage", dest="stage_filter", default=None, help="the version assigned this stage")
    q.add_argument("-o", "--out", default=None, help="the folder to write (must not exist)")
    results = q.add_mutually_exclusive_group()
    results.add_argument(
        "--with-results",
        action="store_true",
        help="fail unless the policy's card gains the evaluate stage's held-out results at the version's "
        "commit (by default it gains them when that commit has them; SHA256SUMS gets the card's new hash)",
    )
    results.add_argument(
        "--as-recorded", action="store_true", help="the bytes exactly as dvc.lock records them (no results)"
    )
