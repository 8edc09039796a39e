"""`rlhf label`: people label in Label Studio: tasks out (export), annotations in (import), the interface (config),
and blind side-by-side rounds (compare, verdicts)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline import numerics, paths, side_by_side
from rlhf_pipeline.arguments import fraction, whole_number
from rlhf_pipeline.commands.base import (
    command,
    never_over_inputs,
    project_of,
    project_root,
    refuse_owned,
    writing,
)
from rlhf_pipeline.errors import SettingsError, quoted
from rlhf_pipeline.io import CHECKSUMS, atomic_file, verify_checksums
from rlhf_pipeline.label_studio import export as label_export
from rlhf_pipeline.label_studio import interface as label_interface
from rlhf_pipeline.label_studio.client import TOKEN_VARIABLE, URL_VARIABLE, send_tasks
from rlhf_pipeline.label_studio.importing import import_labels, open_export
from rlhf_pipeline.params.labelling import LabellingParams
from rlhf_pipeline.params.schema import load_params
from rlhf_pipeline.project_files import project_relative
from rlhf_pipeline.project_key import project_key

# what `rlhf label import` accepts back in a task (label_studio.export.task_data): an export never makes
# a task the import refuses
RESPONSES = whole_number(2, label_export.MAX_SAMPLES)


SEED = whole_number(0, label_export.INTEGER_FIELDS["seed"] - 1)


ROUND = whole_number(0, label_export.INTEGER_FIELDS["round"] - 1)


def cmd_label(args) -> int:
    """Label Studio tasks out (export), its annotations in (import), or its labelling interface (config)."""
    import json

    if args.action == "config":
        if args.side_by_side:
            print(side_by_side.label_config(), end="")
        else:
            print(label_interface.label_config(args.n), end="")
        return 0
    if args.action == "compare":
        return _label_compare(args)
    if args.action == "verdicts":
        return _label_verdicts(args)
    if args.action == "export":
        never_over_inputs(args.output, args.queries, args.model)
        if args.model_name is not None and (Path(args.model_name).is_absolute() or ".." in args.model_name):
            raise SettingsError(  # it is written into every task: a host's path stays out of them
                f"--model-name {quoted(args.model_name)}: a name (policy@v2, base), not a path outside the project. "
                "Nothing was sampled or written."
            )
        params = load_params(args.params)
        refuse_owned(args.output, "OUTPUT", params)
        _compute_as_the_stages(params)
        task = params.task
        from rlhf_pipeline.label_studio.tasks import export_tasks  # loads torch and transformers: only when exporting

        with sampling_model(args.model) as (folder, name):
            tasks = export_tasks(
                folder, args.queries, task, args.split, args.num, args.n, args.seed, args.round, args.model_name or name
            )
        with writing(args.output), atomic_file(args.output) as out:
            json.dump(tasks, out, indent=1, ensure_ascii=False)
        print(
            f"{args.output}: {len(tasks)} best-of-{args.n} tasks from {name} (round {args.round}); "
            f"labelling interface: rlhf label config --n {args.n}"
        )
        return 0
    params = load_params(args.params) if Path(args.params).exists() else None
    limits = params.labelling if params is not None else LabellingParams()
    golden = params.promotion.golden_labels if params is not None else None
    target = args.paths[-1] if args.paths else None  # OUTPUT is the last path, with or without INPUT
    if golden is not None and target is not None and Path(target).resolve() == Path(golden).resolve():
        raise SettingsError(
            f"{target} is promotion.golden_labels in {args.params}: the golden set a frozen judge is trained and "
            "measured on, kept apart from every round so that a round of bad labels cannot reach the judge. Import "
            "into the labels file (data.preferences.source) instead; nothing was written."
        )
    min_agreement = args.min_agreement
    if min_agreement is None and params is not None:
        min_agreement = params.data.validation.min_agreement
    root = project_root("label")
    if target is not None:
        refuse_owned(target, "OUTPUT", params, appending=args.append, root=root)
    source, project = _label_import_paths(args)
    # read, merge and write under the file's lock: two imports at once each keep the other's rows
    with writing(args.output):
        summary = import_labels(
            source,
            args.output,
            key=project_key(root),
            limits=limits,
            project=project,
            min_agreement=min_agreement,
            append=args.append,
        )
    print(json.dumps(summary, indent=2))
    return 0


def _label_compare(args) -> int:
    """``rlhf label compare``: a blind side-by-side round of two models (rlhf_pipeline.side_by_side), its
    tasks written to OUTPUT, sent to a Label Studio project (``--send``), or both."""
    import json

    from rlhf_pipeline import side_by_side_sampling  # loads torch and transformers: only when this command runs

    if args.output is None and args.send is None:
        raise SettingsError(
            "rlhf label compare CHALLENGER INCUMBENT takes OUTPUT (a tasks file to import by hand), --send PROJECT "
            "(straight to a Label Studio project), or both. Nothing was sampled."
        )
    if args.output is not None:
        never_over_inputs(args.output, args.queries, args.challenger, args.incumbent)
    params = load_params(args.params)
    root = project_root("label")
    if args.output is not None:
        refuse_owned(args.output, "OUTPUT", params, root=root)
    _compute_as_the_stages(params)
    num = args.num if args.num is not None else params.promotion.human.num_queries
    seed = args.seed if args.seed is not None else params.promotion.human.seed
    with sampling_model(args.challenger) as challenger, sampling_model(args.incumbent) as incumbent:
        side_by_side.refuse_existing_round(root, challenger[1], incumbent[1])
        tasks, record = side_by_side_sampling.sample_round(challenger, incumbent, args.queries, params.task, num, seed)
    with writing(args.output or side_by_side.ROUNDS), side_by_side.rounds_lock(root):
        side_by_side.refuse_existing_round(root, record.challenger, record.incumbent)  # one sampled meanwhile
        if args.send is not None:  # sent before the round is kept: a refused send leaves no round to wait on
            send_tasks(args.send, tasks, params.labelling)
        kept = record.save(root).relative_to(root)
        if args.output is not None:
            with atomic_file(args.output) as out:
                json.dump(tasks, out, indent=1, ensure_ascii=False)
    where = " and ".join(
        [f"written to {args.output}"] * (args.output is not None)
        + [f"sent to Label Studio project {args.send}"] * (args.send is not None)
    )
    print(
        f"{len(tasks)} side-by-side tasks, {record.challenger} against {record.incumbent} (seed {seed}), {where}; "
        f"which model wrote Response A is kept in {kept}, not in the tasks. Labelling interface: "
        "rlhf label config --side-by-side"
    )
    return 0


def _label_verdicts(args) -> int:
    """``rlhf label verdicts``: people's answers to side-by-side tasks into their rounds' files."""
    import json

    limits = load_params(args.params).labelling if Path(args.params).exists() else LabellingParams()
    if (args.input is None) == (args.from_server is None):
        raise SettingsError(
            "rlhf label verdicts takes INPUT (Label Studio's JSON export) or --from-server PROJECT: one of the two."
        )
    handle, where = open_export(args.input, args.from_server, limits)
    with handle, writing(side_by_side.ROUNDS):
        rounds, report = side_by_side.import_verdicts(handle, where, project_root("label"), limits)
    print(json.dumps({"rounds": [r.name for r in rounds], **report.summary()}, indent=2))
    return 0


def _compute_as_the_stages(params) -> None:
    """Before the first sample: what ``params.compute`` asks, as a stage gets it (the runner's pin, then the
    device plan and attention every model stage resolves first)."""
    numerics.pin(params.compute.cpu_numerics, params.compute.cpu_threads)
    from rlhf_pipeline.devices import resolve_compute  # torch and transformers: only when sampling

    resolve_compute(params.compute)


@contextmanager
def sampling_model(model: str) -> Iterator[tuple[str, str]]:
    """(a model folder, what tasks call it) for ``rlhf label export --model``: a folder as given, or a
    registered version (``policy#prod``, ``policy@v2``) fetched and checked into a temporary folder for
    the time it samples (its tag, ``policy@v2.0.0``, names it)."""
    if len(model) > 4096 or not model.isprintable():
        raise SettingsError(f"--model {quoted(model)}: not a model folder or a version (unprintable, or too long).")
    if Path(model).is_dir():
        root = project_root("label")
        # tasks and rounds name the folder by its path in the project, never by an absolute host path
        relative = project_relative(model, root, "the model folder")
        if (root / relative / CHECKSUMS).is_file():  # a stage's output: its bytes as it wrote them, or no sample
            verify_checksums(root / relative, f"restore {relative} with `dvc checkout`")
        yield str(root / relative), relative
        return
    if not any(mark in model for mark in "@#"):
        raise SettingsError(
            f"--model {quoted(model)}: no such model folder, and not a registry version (policy@v2, policy#prod); "
            "nothing was sampled or written."
        )
    import tempfile

    from rlhf_pipeline import registry  # loads GTO: only for a registered version
    from rlhf_pipeline.fetching import fetch  # loads DVC: only for a registered version

    root = project_of(None, "label")
    version = registry.resolve(root, model)
    with tempfile.TemporaryDirectory(prefix=".label-export-", dir=root) as scratch:
        fetch(root, version.artifact, version.version, None, Path(scratch) / "model")
        yield str(Path(scratch) / "model"), version.tag


def _label_import_paths(args) -> tuple[str | None, int | None]:
    """(the export file, or None; the Label Studio project, or None) of `rlhf label import`: the file
    ``INPUT``, or ``--from-server PROJECT``; sets ``args.output``."""
    if args.from_server is not None:
        if len(args.paths) != 1:
            raise SettingsError("rlhf label import --from-server PROJECT takes one path: OUTPUT (the .jsonl to write).")
        args.output = args.paths[0]
        return None, args.from_server
    if len(args.paths) != 2:
        raise SettingsError(
            "rlhf label import takes INPUT OUTPUT (Label Studio's JSON export, the .jsonl to write), "
            "or --from-server PROJECT OUTPUT."
        )
    args.input, args.output = args.paths
    never_over_inputs(args.output, args.input)
    return args.input, None


def _project_option(parser, flag: str, does: str) -> None:
    """A Label Studio project's id (``PROJECT``, at least 1) as ``flag``; the server and token from the environment."""
    parser.add_argument(
        flag,
        type=whole_number(1),
        default=None,
        metavar="PROJECT",
        help=f"{does} Label Studio project PROJECT at ${URL_VARIABLE} with ${TOKEN_VARIABLE}",
    )


def _add_side_by_side_parsers(label) -> None:
    """``rlhf label compare`` and ``rlhf label verdicts``: blind side-by-side rounds of two models."""
    q = command(
        label,
        "compare",
        "a blind side-by-side round: one response from each model per held-out query -> Label Studio tasks",
        "rlhf label compare policy@v2 policy#prod tasks.json",
        "rlhf label compare policy@v2 policy#prod --send 3",
    )
    q.add_argument("challenger", help="a model folder or a registered version (policy@v2)")
    q.add_argument("incumbent", help="a model folder or a registered version (policy#prod, models/base)")
    q.add_argument("output", nargs="?", default=None, help="the tasks (JSON) to import into Label Studio by hand")
    _project_option(q, "--send", "send the tasks to")
    q.add_argument("--queries", default=paths.QUERIES)
    q.add_argument(
        "--num", type=whole_number(1), default=None, help="held-out queries (default: promotion.human.num_queries)"
    )
    q.add_argument("--seed", type=SEED, default=None, help="the sampling seed (default: promotion.human.seed)")
    q.add_argument("--params", default="params.yaml")
    q = command(
        label,
        "verdicts",
        "people's answers to side-by-side tasks (an export file, or pulled) -> their round's file",
        "rlhf label verdicts export.json",
        "rlhf label verdicts --from-server 3",
    )
    q.add_argument("input", nargs="?", default=None, help="Label Studio's JSON export (not with --from-server)")
    _project_option(q, "--from-server", "pull the answers from")
    q.add_argument("--params", default="params.yaml")


def add_parser(sub) -> None:
    p = command(
        sub,
        "label",
        "people label: Label Studio tasks out, annotations in (best-of-N rows), side-by-side rounds",
        "rlhf label export tasks.json --model policy#prod --round 2",
        "rlhf label import export.json data/labels/human.jsonl --append",
    )
    label = p.add_subparsers(dest="action", required=True)
    q = command(
        label,
        "config",
        "print the Label Studio labelling interface (XML) for best-of-N, or for side-by-side rounds",
        "rlhf label config --n 4 > best_of_4.xml",
        "rlhf label config --side-by-side",
    )
    q.add_argument("--n", type=RESPONSES, default=4, help="responses per task (4: OpenAI's best-of-4; 2: pairwise)")
    q.add_argument("--side-by-side", action="store_true", help="the interface of `rlhf label compare`'s tasks")
    _add_side_by_side_parsers(label)
    q = command(
        label,
        "export",
        "sample N responses per query from a model; write Label Studio tasks (JSON)",
        "rlhf label export tasks.json --model policy#prod --num 64 --n 4 --round 2",
    )
    q.add_argument("output")
    q.add_argument(
        "--model",
        default=paths.POLICY,
        help="the model that samples: a folder (models/base) or a registered version (policy#prod, policy@v2)",
    )
    q.add_argument(
        "--model-name", default=None, help="what the tasks call the model; default: the version's tag, or --model"
    )
    q.add_argument("--queries", default=paths.QUERIES)
    q.add_argument("--split", default="train", choices=["train", "test"])
    q.add_argument("--num", type=whole_number(1), default=64, help="queries (the first NUM of the split)")
    q.add_argument("--n", type=RESPONSES, default=4, help="responses per query, as `rlhf label config --n`")
    q.add_argument("--seed", type=SEED, default=0, help="the sampling seed (recorded in each task)")
    q.add_argument("--round", type=ROUND, default=1, help="the labelling round (recorded in each task and row)")
    q.add_argument("--params", default="params.yaml", help="the task section's sampling (temperature, length)")
    q = command(
        label,
        "import",
        "Label Studio's JSON export (a file, or pulled from the server) -> best-of-N preference rows (.jsonl)",
        "rlhf label import export.json data/labels/human.jsonl --append",
        "rlhf label import --from-server 3 data/labels/human.jsonl --append",
    )
    q.add_argument(
        "paths", nargs="+", metavar="[INPUT] OUTPUT", help="the export file (not with --from-server), the .jsonl"
    )
    _project_option(q, "--from-server", "pull the annotations from")
    q.add_argument(
        "--min-agreement",
        type=fraction,
        default=None,
        help="refuse below this agreement (default: data.validation.min_agreement)",
    )
    q.add_argument("--params", default="params.yaml")
    q.add_argument(
        "--append",
        action="store_true",
        help="keep OUTPUT's rows (earlier rounds) and add the new (task_id, annotator)s",
    )
    p.set_defaults(func=cmd_label)
