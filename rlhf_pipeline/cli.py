"""The ``rlhf`` command: checks and audits around the DVC pipeline.

Each subcommand is a ``cmd_*`` function set as its parser's default ``func``: it gets the parsed
args and returns an exit code. User errors (:class:`PipelineError`) print one paragraph and exit non-zero, no traceback.

Each command imports the modules it needs when it runs, not at start-up: ``rlhf check-params``
and ``rlhf --version`` then start without torch, transformers, Great Expectations or DVC's repo
(check-params loads torch only to check the ppo section against a built ``models/base``).
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: the rlhf command runs offline and quiet)

import argparse
import gc
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline import __version__, numerics, paths, side_by_side
from rlhf_pipeline.arguments import fraction, whole_number
from rlhf_pipeline.datadocs import check_docs_folder
from rlhf_pipeline.environment import environment_record, record_lines
from rlhf_pipeline.errors import ParamsError, PipelineError, SettingsError, StorageError, quoted
from rlhf_pipeline.file_lock import held
from rlhf_pipeline.io import atomic_file
from rlhf_pipeline.label_studio import export as label_export
from rlhf_pipeline.label_studio import interface as label_interface
from rlhf_pipeline.label_studio.importing import import_labels, open_export
from rlhf_pipeline.params import read_params_file
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import SIMULATED
from rlhf_pipeline.params.labelling import LabellingParams
from rlhf_pipeline.params.promotion import REGISTERED_JUDGE
from rlhf_pipeline.params.schema import load_params, parse_params
from rlhf_pipeline.project_files import project_relative, refuse_project_file
from rlhf_pipeline.project_key import project_key
from rlhf_pipeline.redaction import RedactingStream
from rlhf_pipeline.runner import declared_keys_by_stage, missing_key_problems, report_error, report_unexpected


def check_params_file(path: str | os.PathLike, root: str | os.PathLike) -> None:
    """Validate the whole params file at ``path`` against the schema, and check that it spells out
    every key ``root``/dvc.yaml tracks (DVC does not know the schema's defaults); ParamsError otherwise."""
    raw = read_params_file(path)
    parse_params(raw, str(path))
    problems = missing_key_problems(raw, declared_keys_by_stage(root))
    if problems:
        raise ParamsError(str(path), problems)


def project_of(given: str | None, command: str, required: bool = True) -> Path | None:
    """The DVC project a command works on: the nearest folder holding ``.dvc/`` at or above ``given``
    (``--root``), else at or above the working directory, found as `dvc` finds its own (DVC's
    ``Repo.find_root``), so the command works from `data/` as from the project's root. None
    when there is none and ``required`` is false (the caller falls back to the working directory);
    else one paragraph naming where it looked, never an empty answer about the wrong folder."""
    from dvc.exceptions import NotDvcRepoError  # loads part of DVC (about 0.5 s): only for the commands with --root
    from dvc.repo import Repo

    try:
        return Path(Repo.find_root(given or os.curdir))
    except NotDvcRepoError as error:
        if given is None and not required:
            return None
        if given is not None and not Path(given).is_dir():
            problem = f"--root {given} is not a folder"
        else:
            where = f"--root {given}" if given else f"the working directory, {Path.cwd()},"
            problem = f"{where} is not in a DVC project: no .dvc folder in it or in any folder above it (DVC: {error})"
        raise SettingsError(
            f"{problem}. Run `rlhf {command}` in the project (the folder where `dvc init` ran, holding dvc.yaml) or "
            "in one of its folders, or pass --root with it; nothing was read or written."
        ) from None


def check_fit_to_base_model(path: str | os.PathLike, root: Path) -> str | None:
    """The values that depend on the model (``ppo.freeze_layers``, ``ppo.lora``,
    ``reward.train.num_layers``, query + response length, ``task.truncate_token``) against ``root``/models/base when it
    was built from the params' ``base_model.source`` (ParamsError when they cannot train it); else
    why this was not checked."""
    from rlhf_pipeline.fit import model_fit_problems  # loads torch and transformers: only when models/base is checked
    from rlhf_pipeline.modelcard import read_card  # loads huggingface_hub: the same
    from rlhf_pipeline.models import load_tokenizer, model_skeleton  # the same

    params, base = parse_params(read_params_file(path), str(path)), root / "models" / "base"
    if not (base / "config.json").is_file():
        return "no models/base yet, so the values that depend on the model were not checked (base_model does)"
    built_from = read_card(base).get("source")
    if built_from != params.base_model.source:
        return (
            f"models/base was built from {built_from!r}, not base_model.source {params.base_model.source!r}, so the "
            "values that depend on the model were not checked (base_model does)"
        )
    problems = model_fit_problems(
        model_skeleton(base),
        str(base),
        params.ppo,
        params.reward.train.num_layers,
        params.data.queries.query_length,
        params.task.response_length,
        load_tokenizer(base),
        params.task.truncate_token,
    )
    if problems:
        raise ParamsError(str(path), problems)
    return None


def cmd_check_params(args) -> int:
    root = Path(args.path).resolve().parent  # against the dvc.yaml next to the file
    check_params_file(args.path, root)
    skipped = []
    if not read_params_file(args.path):
        skipped.append("the file sets nothing: every value is the schema's default")
    if not (root / "dvc.yaml").is_file():
        skipped.append(f"no dvc.yaml in {root}, so whether it spells out every key a stage tracks was not checked")
    rule = parse_params(read_params_file(args.path), str(args.path)).promotion
    for key, value in (("promotion.judge", rule.frozen_judge), ("promotion.golden_labels", rule.golden_labels)):
        if value is not None and not REGISTERED_JUDGE.fullmatch(value):
            project_relative(value, root, key)  # where its links lead: inside the project, else exit 2
    unchecked = check_fit_to_base_model(args.path, root)
    if unchecked:
        skipped.append(unchecked)
    print("ok" + "".join(f"\nnote: {note}" for note in skipped))
    return 0


def cmd_profile(args) -> int:
    """Show the profiles in ``params/`` next to the params file, or make one the params file."""
    folder = Path(args.params).resolve().parent / "params"
    if not folder.is_dir():
        raise SettingsError(
            f"no profiles folder {folder}: the profiles live in params/ beside the params file, and --params "
            f"{args.params} has none beside it. Run `rlhf profile` in the project, or pass its params.yaml."
        )
    available = sorted(p.stem for p in folder.glob("*.yaml"))
    if args.name is None:
        print("\n".join(available) if available else f"no profiles in {folder}")
        return 0
    if args.name not in available:
        raise PipelineError(f"no profile {args.name!r} in {folder}; the profiles are {', '.join(available) or 'none'}.")
    source = folder / f"{args.name}.yaml"
    check_params_file(source, folder.parent)  # a broken profile never replaces a working params file
    with atomic_file(args.params, "wb") as handle:
        handle.write(source.read_bytes())
    print(
        f"{args.params} is now the {args.name} profile ({source}): run `dvc repro` (`dvc params diff` shows the change)"
    )
    return 0


def cmd_environment(args) -> int:
    """The running environment against the lock: the record a model card gets; --check: exit 1 on a difference."""
    # outside any project (the Docker image's build step: a lock, no .dvc/) the working directory is the root
    root = Path(args.root) if args.root else project_of(None, "environment", required=False) or Path(os.curdir)
    if not root.is_dir():
        raise SettingsError(f"--root {args.root} is not a folder; pass the one that holds the lock.")
    params = root / "params.yaml"
    compute = load_params(params).compute if params.is_file() else ComputeParams()
    try:  # what the stages would pin here, read back below
        numerics.pin(compute.cpu_numerics, compute.cpu_threads)
        refused = None
    except numerics.NumericsError as error:  # the packages can still be checked on such a host
        refused = f"cpu numerics: the stages would stop here: {error}"
    record = environment_record(root)
    print("\n".join(line.removeprefix("- ") for line in record_lines(record)))
    print(refused or numerics.host_line())
    if args.check and (record["lock_sha256"] is None or record["differs_from_lock"]):
        print(
            f"rlhf environment: the installed packages are not {root / paths.REQUIREMENTS_LOCK}: run "
            "`make setup` (it installs exactly the lock), or `make lock` after changing pyproject.toml.",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_models(args) -> int:
    """The registry: list the versions, run the promotion gate, assign a stage, fetch a version."""
    import json

    from rlhf_pipeline import models_command  # loads GTO (and, for the gate, torch): only when this command runs

    root = project_of(args.root, "models")
    if args.action == "gate":
        result = models_command.gate(root, args.params)
        print(json.dumps(result, indent=2, default=str) if args.json else result["markdown"] or result["outcome"])
        return 0
    if args.action == "assign":
        if not args.name or not args.version:
            raise PipelineError("rlhf models assign NAME VERSION [--stage STAGE]: name the artifact and the version.")
        version = models_command.assign_stage(root, args.name, args.version, args.stage)
        print(f"{args.name}@{version.version} is now {args.stage} (commit {version.commit[:12]})")
        return 0
    if args.action == "get":
        if not args.name or not args.out:
            raise PipelineError(
                "rlhf models get NAME [VERSION | --from-stage STAGE] -o DIR: name the artifact and DIR."
            )
        with writing(args.out):
            with_results = False if args.as_recorded else (True if args.with_results else None)
            got = models_command.fetch(root, args.name, args.version, args.stage_filter, args.out, with_results)
        print(f"{got['out']}: {got['artifact']}@{got['version']} ({got['files_checked']} files match its SHA256SUMS)")
        if got["results"]:
            print(f"{got['out']}/README.md: the card holds the version's held-out results (also as its model-index)")
        return 0
    rows = models_command.listing(root)
    print(json.dumps(rows, indent=2, default=str) if args.json else models_command.render_listing(rows))
    return 0


def cmd_validate_preferences(args) -> int:
    from rlhf_pipeline.contract import validate_file_cli  # loads Great Expectations: only when this command runs

    never_over_inputs(args.result, args.path)
    for output, option in ((args.result, "--result"), (args.docs, "--docs")):
        refuse_owned(output, option, _params_if_there(args.params))
    if args.docs:
        check_docs_folder(args.docs)  # before the contract runs, not after it has printed its verdict
    with writing(args.result or args.docs or "the result"):
        return validate_file_cli(args.path, params_path=args.params, result_path=args.result, docs_dir=args.docs)


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


def never_over_inputs(output: str | os.PathLike | None, *inputs: str | os.PathLike | None) -> None:
    """Refuse an ``output`` that is one of the command's ``inputs`` or lies inside an input folder: the
    write would replace or change what the command reads (`rlhf label import export.json export.json`
    replaced Label Studio's export with its rows). SettingsError, before anything is written."""
    if output is None:
        return
    target = Path(output).resolve()
    for given in inputs:
        source = None if given is None else Path(given).resolve()
        if source is not None and (target == source or source in target.parents):
            relation = (
                f"is also this command's input ({given}): writing it would replace"
                if target == source
                else f"is inside {given}, which this command reads: writing it would change"
            )
            raise SettingsError(
                f"{output} {relation} what the command reads. Choose another path; nothing was written."
            )


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """An OS error while writing a command's output (the path is under a file, in /proc, not
    writable) as one paragraph with the output's exit code, not a traceback."""
    try:
        yield
    except PipelineError:
        raise
    except OSError as error:
        raise StorageError(
            f"could not write {path}: {error.strerror or error}. Choose a path in a folder you can write to; "
            "nothing was written."
        ) from None


def cmd_export_preferences(args) -> int:
    # loads torch and datasets: only when this command runs
    from rlhf_pipeline.preferences.export import export_pairwise

    never_over_inputs(args.output, args.input)
    refuse_owned(args.output, "OUTPUT", _params_if_there("params.yaml"))
    with writing(args.output):
        count = export_pairwise(args.input, args.split, args.output)
    print(f"{args.output}: {count} pairs (prompt, chosen, rejected) from {args.input} [{args.split}]")
    return 0


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
        numerics.pin(params.compute.cpu_numerics, params.compute.cpu_threads)  # before the first sample
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


def _params_if_there(path: str):
    """The params at ``path`` when the file is there (a command that also runs outside a project)."""
    return load_params(path) if Path(path).is_file() else None


def project_root(command: str) -> Path:
    """The DVC project a command that writes project files works in, else the working directory."""
    return project_of(None, command, required=False) or Path.cwd()


def refuse_owned(output: str | None, option: str, params, appending: bool = False, root: Path | None = None) -> None:
    """A command's ``output`` is never a file the project owns (rlhf_pipeline.project_files): exit 2."""
    labels = params.data.preferences.source if params is not None else None
    refuse_project_file(
        output,
        root or project_root("label"),
        option,
        labels=None if labels == SIMULATED else labels,
        golden=params.promotion.golden_labels if params is not None else None,
        appending=appending,
    )


def _label_compare(args) -> int:
    """``rlhf label compare``: a blind side-by-side round of two models (rlhf_pipeline.side_by_side)."""
    import json

    from rlhf_pipeline import side_by_side_sampling  # loads torch and transformers: only when this command runs

    never_over_inputs(args.output, args.queries, args.challenger, args.incumbent)
    params = load_params(args.params)
    root = project_root("label")
    refuse_owned(args.output, "OUTPUT", params, root=root)
    numerics.pin(params.compute.cpu_numerics, params.compute.cpu_threads)  # before the first sample
    num = args.num if args.num is not None else params.promotion.human.num_queries
    seed = args.seed if args.seed is not None else params.promotion.human.seed
    with sampling_model(args.challenger) as challenger, sampling_model(args.incumbent) as incumbent:
        side_by_side.refuse_existing_round(root, challenger[1], incumbent[1])
        tasks, record = side_by_side_sampling.sample_round(challenger, incumbent, args.queries, params.task, num, seed)
    with writing(args.output), held(root / side_by_side.ROUNDS):
        side_by_side.refuse_existing_round(root, record.challenger, record.incumbent)  # one sampled meanwhile
        kept = record.save(root).relative_to(root)
        with atomic_file(args.output) as out:
            json.dump(tasks, out, indent=1, ensure_ascii=False)
    print(
        f"{args.output}: {len(tasks)} side-by-side tasks, {record.challenger} against {record.incumbent} "
        f"(seed {seed}); which model wrote Response A is kept in {kept}, not in the tasks. Labelling interface: "
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
        yield str(root / relative), relative
        return
    if not any(mark in model for mark in "@#"):
        raise SettingsError(
            f"--model {quoted(model)}: no such model folder, and not a registry version (policy@v2, policy#prod); "
            "nothing was sampled or written."
        )
    import tempfile

    from rlhf_pipeline import models_command, registry  # loads DVC and GTO: only for a registered version

    root = project_of(None, "label")
    version = registry.resolve(root, model)
    with tempfile.TemporaryDirectory(prefix=".label-export-", dir=root) as scratch:
        models_command.fetch(root, version.artifact, version.version, None, Path(scratch) / "model")
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


def cmd_plots_page(args) -> int:
    from rlhf_pipeline.plots_page import write_offline_page_template  # loads vl-convert: only when this runs

    root = project_of(args.root, "plots-page")
    with writing(root / ".dvc"):
        path = write_offline_page_template(root)
    print(f"{path}: `dvc plots show` and `dvc plots diff` now draw with no network (.dvc/config plots.html_template)")
    return 0


def command(group, name: str, summary: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` opens with what it does (``summary``, also its line in the group's
    list) and ends with how it is called (``examples``)."""
    return group.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog="example" + ("s" if len(examples) > 1 else "") + ":\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _add_lineage_parser(sub) -> None:
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


def _add_models_parser(sub) -> None:
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


# what `rlhf label import` accepts back in a task (label_studio.export.task_data): an export never makes
# a task the import refuses
RESPONSES = whole_number(2, label_export.MAX_SAMPLES)
SEED = whole_number(0, label_export.INTEGER_FIELDS["seed"] - 1)
ROUND = whole_number(0, label_export.INTEGER_FIELDS["round"] - 1)


def _add_side_by_side_parsers(label) -> None:
    """``rlhf label compare`` and ``rlhf label verdicts``: blind side-by-side rounds of two models."""
    q = command(
        label,
        "compare",
        "a blind side-by-side round: one response from each model per held-out query -> Label Studio tasks",
        "rlhf label compare policy@v2 policy#prod tasks.json",
    )
    q.add_argument("challenger", help="a model folder or a registered version (policy@v2)")
    q.add_argument("incumbent", help="a model folder or a registered version (policy#prod, models/base)")
    q.add_argument("output", help="the tasks (JSON) to import into Label Studio")
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
    q.add_argument(
        "--from-server", type=whole_number(1), default=None, metavar="PROJECT", help="pull project PROJECT's answers"
    )
    q.add_argument("--params", default="params.yaml")


def _add_label_parser(sub) -> None:
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
    q.add_argument(
        "--from-server",
        type=whole_number(1),
        default=None,
        metavar="PROJECT",
        help="pull project PROJECT's annotations from the server at $LABEL_STUDIO_URL with $LABEL_STUDIO_API_KEY",
    )
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


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors show what the user typed cut and escaped (a 100 kB
    argument or a control character would otherwise be echoed whole)."""

    def error(self, message: str):
        super().error(message if len(message) <= 300 and message.isprintable() else quoted(message, 300))


def _add_project_parsers(sub) -> None:
    """``rlhf check-params``, ``profile`` and ``environment``: the project's params and packages."""
    p = command(
        sub,
        "check-params",
        "validate params.yaml: prints ok, or one line per problem and exits 2",
        "rlhf check-params",
        "rlhf check-params params/gpu.yaml",
    )
    p.add_argument("path", nargs="?", default="params.yaml")
    p.set_defaults(func=cmd_check_params)

    p = command(
        sub,
        "profile",
        "list the profiles in params/, or copy one over params.yaml (validated first)",
        "rlhf profile",
        "rlhf profile tiny && dvc repro",
    )
    p.add_argument(
        "name",
        nargs="?",
        help="a file of params/ without .yaml; shipped: cpu (the default), tiny (a quick look), reference (the "
        "lm-human-preferences values), gpu (those sizes on one CUDA GPU), gemma (Gemma 3 270M)",
    )
    p.add_argument("--params", default="params.yaml")
    p.set_defaults(func=cmd_profile)

    p = command(
        sub,
        "environment",
        "the installed packages against requirements.lock (what each model card records)",
        "rlhf environment --check",
    )
    p.add_argument(
        "--root",
        default=None,
        help="the folder holding requirements.lock (default: the DVC project holding the "
        "working directory, else the working directory)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a package differs from the lock")
    p.set_defaults(func=cmd_environment)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rlhf", description="RLHF-with-PPO pipeline tools (the stages run through `dvc repro`).")
    parser.add_argument("--version", action="version", version=f"rlhf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_project_parsers(sub)
    _add_models_parser(sub)

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

    _add_lineage_parser(sub)

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

    _add_label_parser(sub)

    p = command(
        sub,
        "plots-page",
        "(re)write the page template that lets `dvc plots show` draw offline (vega inlined)",
        "rlhf plots-page && dvc plots show",
    )
    p.add_argument(
        "--root",
        default=None,
        help="the DVC project, the template goes in its .dvc/plots/ (default: the one holding the working directory)",
    )
    p.set_defaults(func=cmd_plots_page)
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
