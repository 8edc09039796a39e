"""`rlhf lineage`: which stage, params, inputs, commit and metrics made an artifact (:mod:`rlhf_pipeline.lineage`)."""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.commands.base import (
    command,
    project_of,
)
from rlhf_pipeline.errors import PipelineError, SettingsError, quoted


def cmd_lineage(args) -> int:
    import json

    from rlhf_pipeline.lineage.diff import diff_versions, render_diff  # loads DVC's repo: only when this runs
    from rlhf_pipeline.lineage.render import lineage_cli  # the same
    from rlhf_pipeline.lineage.verify import verify_cli  # the same
    from rlhf_pipeline.registry import declared_artifacts, resolve  # loads GTO: the same

    if args.diff:
        result = diff_versions(project_of(args.root, "lineage"), *args.diff, namespace=args.namespace)
        print(json.dumps(result, indent=2, default=str) if args.json else render_diff(result))
        return 0
    if not args.path:
        raise PipelineError("rlhf lineage PATH (or NAME@VERSION, or --diff A B): name what to trace.")
    path, rev = args.path, args.rev
    if len(path) > 4096 or not path.isprintable():
        raise SettingsError(f"rlhf lineage {quoted(path)}: not a path or a version (unprintable, or too long).")
    name = path.split("@")[0].split("#")[0]
    if ("@" in path or "#" in path) and not Path(path).exists():
        root = project_of(args.root, "lineage")
        if name in declared_artifacts(root):
            version = resolve(root, path)  # a registry version: its artifact at its commit
            path, rev = str(root / declared_artifacts(root)[name]["path"]), version.commit
    if args.verify:
        if rev:
            raise PipelineError("--verify checks the workspace's bytes; it takes no revision or version.")
        return verify_cli(path)
    return lineage_cli(path, as_json=args.json, namespace=args.namespace, rev=rev)


def add_parser(sub) -> None:
    p = command(
        sub,
        "lineage",
        "which stage, params, inputs, commit and metrics produced a DVC-tracked artifact",
        "rlhf lineage models/policy",
        "rlhf lineage policy@v2 --json",
        "rlhf lineage --diff policy@v1 policy@v2",
        "rlhf lineage --verify .",
    )
    p.add_argument("path", nargs="?", help="an artifact path, or a registry version (policy@v2, policy#prod)")
    p.add_argument("--rev", default=None, help="read PATH as git revision REV recorded it (nothing is checked out)")
    p.add_argument(
        "--diff",
        nargs=2,
        metavar=("A", "B"),
        help="what changed from A to B (versions such as policy@v1, or PATH@REV): preference rows, params, "
        "code, packages, metrics",
    )
    p.add_argument(
        "--root",
        default=None,
        help="the project, for registry versions and --diff (default: the one holding the working directory)",
    )
    p.add_argument("--json", action="store_true", help="emit an OpenLineage-shaped run event")
    p.add_argument(
        "--namespace",
        default=None,
        help="the OpenLineage namespace (default: $OPENLINEAGE_NAMESPACE, else made from the git remote "
        "origin, e.g. dvc://github.com/org/repo, else dvc://local)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="re-hash every file of PATH (the project root: every output) from its bytes against dvc.lock and the "
        "DVC cache, bypassing DVC's state db; exit 7 on any mismatch",
    )
    p.set_defaults(func=cmd_lineage)
