"""`rlhf check-params`, `rlhf profile`, `rlhf environment` and `rlhf plots-page`: the project's params, packages
and plot template."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlhf_pipeline import numerics, paths
from rlhf_pipeline.commands.base import (
    command,
    project_of,
    writing,
)
from rlhf_pipeline.environment import environment_record, record_lines
from rlhf_pipeline.errors import ParamsError, PipelineError, SettingsError
from rlhf_pipeline.io import atomic_file
from rlhf_pipeline.params import read_params_file
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.promotion import REGISTERED_JUDGE
from rlhf_pipeline.params.schema import load_params, parse_params
from rlhf_pipeline.project_files import project_relative
from rlhf_pipeline.runner import declared_keys_by_stage, missing_key_problems


def check_params_file(path: str | os.PathLike, root: str | os.PathLike) -> None:
    """Validate the whole params file at ``path`` against the schema, and check that it spells out
    every key ``root``/dvc.yaml tracks (DVC does not know the schema's defaults); ParamsError otherwise."""
    raw = read_params_file(path)
    parse_params(raw, str(path))
    problems = missing_key_problems(raw, declared_keys_by_stage(root))
    if problems:
        raise ParamsError(str(path), problems)


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


def cmd_plots_page(args) -> int:
    from rlhf_pipeline.plots_page import write_offline_page_template  # loads vl-convert: only when this runs

    root = project_of(args.root, "plots-page")
    with writing(root / ".dvc"):
        path = write_offline_page_template(root)
    print(f"{path}: `dvc plots show` and `dvc plots diff` now draw with no network (.dvc/config plots.html_template)")
    return 0


def add_parsers(sub) -> None:
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


def add_plots_page_parser(sub) -> None:
    """``rlhf plots-page``."""
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
