"""``rlhf models``: the registry's versions with their metrics, the promotion gate, a stage
assigned by hand (a rollback), and a version's exact bytes fetched and checked.

The registry itself (GTO's tags) is :mod:`rlhf_pipeline.registry`; the gate's rule is
:mod:`rlhf_pipeline.promotion`; this module joins them to the workspace: it reads the
challenger's evaluation, loads its reward model and the judge, and assigns ``prod``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_pipeline import metric_keys as keys
from rlhf_pipeline import paths
from rlhf_pipeline.errors import DamagedArtifactError, DataContractError, PipelineError, plain
from rlhf_pipeline.gitrepo import commit_staged, file_at, git
from rlhf_pipeline.io import CHECKSUMS, checksum_problems, read_checksums, verify_checksums, write_checksums
from rlhf_pipeline.label_studio.client import fetch_export, send_tasks
from rlhf_pipeline.labelers import get_labeler
from rlhf_pipeline.lineage.verify import tree_md5
from rlhf_pipeline.modelcard import add_held_out_results, held_out_result, read_card
from rlhf_pipeline.params.promotion import REGISTERED_JUDGE, PromotionParams
from rlhf_pipeline.params.schema import Params, load_params
from rlhf_pipeline.project_files import project_relative
from rlhf_pipeline.promotion import (
    Side,
    Tally,
    compare,
    decide,
    human_shortfall,
    limit_kl,
    read_responses,
    render,
)
from rlhf_pipeline.registry import (
    POLICY,
    PROD,
    REWARD_MODEL,
    Version,
    assign,
    dangling_stages,
    declared_artifacts,
    in_stage,
    metrics_at,
    recorded_hash,
    register,
    resolve,
    version_of,
    versions,
)
from rlhf_pipeline.side_by_side import import_verdicts, load_round, refuse_existing_round, round_path, rounds_lock
from rlhf_pipeline.side_by_side import tally as side_by_side_tally

SCORE_BATCH = 64


def listing(root: str | Path) -> list[dict[str, Any]]:
    """Every registered version of every declared artifact, newest first, with its metrics."""
    rows = []
    for name in declared_artifacts(root):
        for version in versions(root, name):
            rows.append(
                {
                    "artifact": name,
                    "version": version.version,
                    "stages": list(version.stages),
                    "registered": version.created_at,
                    "commit": version.commit,
                    "names_a_model": recorded_hash(root, version) is not None,
                    **metrics_at(root, version.commit),
                }
            )
        for stage in dangling_stages(root, name):
            rows.append(
                {
                    "artifact": name,
                    "version": None,
                    "stages": [stage["stage"]],
                    "registered": "",
                    "commit": stage["commit"],
                    "names_a_model": False,
                    "dangling": stage["tag"],
                }
            )
    return rows


def render_listing(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no registered versions yet: the retrain flow registers one per new policy (or `rlhf models gate`)"

    def value(row: dict, key: str, se: str | None = None) -> str:
        number = row.get(key)
        if number is None:
            return "-"
        return f"{number:+.3f} ± {row[se]:.3f}" if se and row.get(se) is not None else f"{number:.3f}"

    lines = [
        "| artifact | version | stage | registered | gold gain (base σ) | proxy gain (base σ) | KL | RM accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        stages = ", ".join(row["stages"]) or "-"
        if row.get("dangling"):  # a stage tag whose version's tag was deleted
            lines.append(
                f"| {row['artifact']} | (none) | {stages} (dangling: {row['dangling']} points at commit "
                f"{row['commit'][:12]}, which has no version tag) | - | - | - | - | - |"
            )
            continue
        if not row.get("names_a_model", True):  # a tag pushed by hand onto a commit without a run
            stages += " (not a version: its commit's dvc.lock records no model)"
        lines.append(
            f"| {row['artifact']} | {row['version']} | {stages} | {row['registered'][:19]} "
            f"| {value(row, 'gold gain', 'gold SE')} | {value(row, 'proxy gain', 'proxy SE')} | {value(row, 'KL')} "
            f"| {value(row, 'RM accuracy')} |"
        )
    return "\n".join(lines)


def require_recorded_run(root: str | Path) -> None:
    """The gate registers HEAD: the run it judges must be what HEAD records."""
    changed = (git(str(root), "status", "--porcelain", "--untracked-files=all", "--", *paths.RUN_RECORD) or "").strip()
    if changed:
        listed = ", ".join(line[3:] for line in changed.splitlines()[:6])
        raise PipelineError(
            f"the run's record differs from HEAD ({listed}): commit dvc.lock, metrics/ and evaluation/ first "
            "(the retrain flow does), so that the version registered is the one evaluated."
        )


def reward_scorer(root: str | Path, folder: str = paths.REWARD):
    """A reward model as a text scorer, in batches: the challenger's (``folder`` = models/reward), or a
    frozen judge's."""
    from rlhf_pipeline.reward.persistence import load_reward_model  # loads torch and transformers: only for the gate

    model = load_reward_model(Path(root, folder))

    def score(queries: list[str], responses: list[str]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(queries), SCORE_BATCH):
            out += model.score(queries[start : start + SCORE_BATCH], responses[start : start + SCORE_BATCH])
        return out

    return score


@contextmanager
def frozen_judge_folder(root: Path, rule: PromotionParams) -> Iterator[Path | None]:
    """The frozen judge's reward-model folder for the time the gate scores (None for a labeler or no
    judge): a folder of the project as it is, or a registered version (``reward-model@v1``) fetched and
    checked into a scratch folder, as `rlhf models get` does; its SHA256SUMS are checked either way."""
    if rule.frozen_judge is None:
        yield None
        return
    if REGISTERED_JUDGE.fullmatch(rule.frozen_judge):
        name, version = rule.frozen_judge.split("@")
        with tempfile.TemporaryDirectory(prefix=".judge-", dir=root) as scratch:
            fetch(root, name, version, None, Path(scratch) / "judge", with_results=False)
            yield Path(scratch) / "judge"
        return
    # the judge scores with what is in the project, never a folder a link or `..` leads out to
    folder = root / project_relative(rule.frozen_judge, root, "promotion.judge")
    if not (folder / CHECKSUMS).is_file():
        raise PipelineError(
            f"promotion.judge {rule.frozen_judge}: no reward model folder with its {CHECKSUMS} there; train the judge "
            "on promotion.golden_labels and put its folder (models/reward of that run) there, then `dvc add` it."
        )
    verify_checksums(folder, f"restore the frozen judge (promotion.judge {rule.frozen_judge}) with `dvc checkout`")
    yield folder


def judge_scorer(root: str | Path, rule: PromotionParams, folder: Path | None = None):
    """The gold judge as a scorer: a labeler, or the frozen judge's reward model in ``folder`` (from
    :func:`frozen_judge_folder`); None without one."""
    if rule.judge is None:
        return None
    if rule.frozen_judge is None:
        labeler = get_labeler(rule.judge)
        return lambda queries, responses: labeler.score(responses)
    return reward_scorer(root, str(folder))


def judge_accuracy(rule: PromotionParams, folder: Path | None) -> str | None:
    """What the frozen judge's card (in ``folder``) says it measured on its own held-out (golden) labels."""
    if rule.frozen_judge is None or folder is None:
        return None
    results = read_card(folder).get("model-index") or []
    measured = [
        f"{metric.get('name')}: {metric.get('value')}"
        for entry in results
        for outcome in entry.get("results", [])
        for metric in outcome.get("metrics", [])
    ]
    golden = f" (golden labels: {rule.golden_labels})" if rule.golden_labels else ""
    said = "; ".join(measured) or "its card records no held-out result"
    return f"frozen judge {rule.frozen_judge}{golden}: {said}"


def incumbent_side(root: str | Path, challenger_rows: list[dict]) -> tuple[Side, Version | None]:
    """What the challenger meets: the version assigned prod, else the base model (first version)."""
    prod = in_stage(root, POLICY, PROD)
    if prod is None:
        return Side(
            "base model", [r["query"] for r in challenger_rows], [r["base_response"] for r in challenger_rows]
        ), None
    text = file_at(root, prod.commit, paths.EVALUATION_RESPONSES)
    if text is None:
        raise PipelineError(
            f"{prod.tag} (prod) has no {paths.EVALUATION_RESPONSES} at {prod.commit[:12]}: it predates the gate. "
            "Assign prod to a version evaluated since (`rlhf models assign policy VERSION`), or rerun its evaluation "
            "and register it."
        )
    rows = read_responses(text, f"{paths.EVALUATION_RESPONSES} at {prod.tag}")
    return Side(prod.tag, [r["query"] for r in rows], [r["policy_response"] for r in rows]), prod


def gate(root: str | Path = ".", params_path: str | Path = "params.yaml") -> dict[str, Any]:
    """Register HEAD's policy (and reward model) and decide whether it takes ``prod``."""
    root = Path(root).resolve()
    params = load_params(root / params_path)
    rule = params.promotion
    if POLICY not in declared_artifacts(root):
        return {"decision": None, "outcome": f"skipped: dvc.yaml declares no {POLICY!r} artifact", "markdown": ""}
    require_recorded_run(root)
    existing, _, _ = version_of(root, POLICY)
    waiting = existing is not None and rule.score == "human" and PROD not in existing.stages
    if existing is not None and not waiting:
        outcome = f"no new version: {existing.tag} already has the policy HEAD records"
        return {"decision": None, "registered": existing.tag, "outcome": outcome, "markdown": ""}
    # judged before it is registered: a comparison that cannot be made leaves no undecided version
    responses = root / paths.EVALUATION_RESPONSES
    if not responses.is_file():
        raise PipelineError(f"{responses} is missing: run `dvc repro evaluate` (and commit) before the gate.")
    rows = read_responses(responses.read_text(), str(responses))
    incumbent, prod = incumbent_side(root, rows)
    evaluated = root / paths.EVALUATION_METRICS
    metrics = json.loads(evaluated.read_text()) if evaluated.is_file() else {}
    with frozen_judge_folder(root, rule) as judge_folder:
        comparison = compare(
            Side("HEAD's policy", [r["query"] for r in rows], [r["policy_response"] for r in rows]),
            incumbent,
            proxy=reward_scorer(root),
            judge=judge_scorer(root, rule, judge_folder),
            judge_name=rule.judge,
            kl=limit_kl(metrics),
        )
        if (accuracy := judge_accuracy(rule, judge_folder)) is not None:
            comparison.notes.append(accuracy)
    challenger, _ = register(root, POLICY, message="retrain: a new policy")
    reward = (
        register(root, REWARD_MODEL, message="retrain: a new reward model")[0]
        if REWARD_MODEL in declared_artifacts(root)
        else None
    )
    comparison.challenger = challenger.tag
    registered = challenger.tag + (f", {reward.tag}" if reward is not None else "")
    if rule.score == "human":
        comparison.human, waits = human_verdicts(root, params, challenger, prod)
        if waits is not None:
            return {"decision": None, "registered": registered, "outcome": waits, "markdown": "", "waiting": True}
    decision = decide(comparison, rule)
    if decision.promote:
        assign(root, POLICY, challenger.version, PROD, message=f"promotion gate: {challenger.tag} passed")
        if reward is not None:
            assign(root, REWARD_MODEL, reward.version, PROD, message=f"promotion gate: with {challenger.tag}")
        outcome = f"{challenger.tag} assigned prod" + (f" (with {reward.tag})" if reward is not None else "")
    else:
        outcome = f"prod stays {prod.tag if prod else 'unassigned'}; {challenger.tag} is registered, not promoted"
    return {
        "decision": decision.as_dict(),
        "registered": registered,
        "outcome": outcome,
        "markdown": render(decision, registered, outcome),
    }


def human_verdicts(
    root: Path, params: Params, challenger: Version, prod: Version | None
) -> tuple[Tally | None, str | None]:
    """``promotion.score: human``: (people's verdicts on ``challenger`` against prod, why the gate waits
    or None). With ``promotion.human.label_studio_project``, a challenger with no round yet has its
    side-by-side tasks sent to that project, and a round's answers are pulled from it (the address and
    token from the environment) before they are counted; without one, the round goes through files
    (``rlhf label compare``, ``rlhf label verdicts``). The round file is committed as it stands."""
    rule, incumbent = params.promotion, prod.tag if prod is not None else paths.BASE_MODEL
    path, wanted = round_path(root, challenger.tag, incumbent), rule.human
    project = wanted.label_studio_project
    if not path.is_file():
        if project is None:
            return None, (
                f"{challenger.tag} is registered and waits for people's side-by-side verdicts against {incumbent}: "
                f"`rlhf label compare {challenger.tag} {incumbent} tasks.json`, import "
                "tasks.json into a Label Studio project whose interface is `rlhf label config --side-by-side`, then "
                "`rlhf label verdicts EXPORT.json` with its export, and run `rlhf models gate` again"
            )
        sent = send_round(root, params, challenger, prod)
        return None, (
            f"{challenger.tag} is registered and waits for people's side-by-side verdicts against {incumbent}: "
            f"{sent} tasks sent to Label Studio project {project}; the next run (or `rlhf models gate`) pulls the "
            "answers and decides"
        )
    if project is not None:
        handle, where = fetch_export(project, params.labelling, doing="the gate's pull of promotion.human's round")
        with handle:
            import_verdicts(handle, where, root, params.labelling)
    commit_round(root, path)
    record = load_round(path, root)  # sealed, and every verdict one person's one answer to a task of the round
    if (record.challenger, record.incumbent) != (challenger.tag, incumbent):
        raise DataContractError(
            f"{path}: the round compares {plain(record.challenger, 80)} with {plain(record.incumbent, 80)}, not "
            f"{challenger.tag} with {incumbent}: its file was renamed or copied. Restore it from git; nothing was "
            "counted."
        )
    tally = side_by_side_tally(record.verdicts, wanted.tie_weight, wanted.confidence)
    short = human_shortfall(tally, rule)
    if short is not None:
        return tally, f"{challenger.tag} is registered and waits: {short}, against {incumbent}"
    return tally, None


def send_round(root: Path, params: Params, challenger: Version, prod: Version | None) -> int:
    """Sample a side-by-side round of ``challenger`` against ``prod`` (or the base model) on the held-out
    queries (``promotion.human``), send its tasks to its Label Studio project, and keep (commit) its
    round file."""
    # loads torch and transformers: only when a round is sampled, so that listing and fetching start without them
    from rlhf_pipeline.side_by_side_sampling import sample_round

    wanted = params.promotion.human
    with tempfile.TemporaryDirectory(prefix=".side-by-side-", dir=root) as scratch:
        mine = fetch(root, POLICY, challenger.version, None, Path(scratch) / "challenger", with_results=False)
        if prod is not None:
            theirs = fetch(root, POLICY, prod.version, None, Path(scratch) / "incumbent", with_results=False)
            incumbent = (theirs["out"], prod.tag)
        else:
            verify_checksums(root / paths.BASE_MODEL, "restore it with `dvc checkout base_model`")
            incumbent = (str(root / paths.BASE_MODEL), paths.BASE_MODEL)
        tasks, record = sample_round(
            (mine["out"], challenger.tag), incumbent, root / paths.QUERIES, params.task, wanted.num_queries, wanted.seed
        )
    with rounds_lock(root):
        refuse_existing_round(root, record.challenger, record.incumbent)
        sent = send_tasks(wanted.label_studio_project, tasks, params.labelling)
        commit_round(root, record.save(root))
    return sent


def commit_round(root: Path, path: Path) -> None:
    """Commit a side-by-side round file as it stands (the order key, the verdicts): a decision people
    made is audited like the version it decides on. Nothing to commit: nothing done."""
    relative = str(path.relative_to(root))
    if not (git(str(root), "status", "--porcelain", "--", relative) or "").strip():
        return
    git(str(root), "add", "--", relative)
    commit_staged(root, [relative], f"side-by-side round {path.stem}")


def fetch(
    root: str | Path,
    name: str,
    version: str | None,
    stage: str | None,
    out: str | Path,
    with_results: bool | None = None,
) -> dict[str, Any]:
    """A version's bytes through ``dvc artifacts get`` (DVC's cache or remote at the version's
    commit), checked file by file against its ``SHA256SUMS`` before they replace ``out``.

    The policy's card was written before the evaluate stage measured it: the card a user gets gains
    the version's held-out results (gold and proxy gain, KL, win rate) in its text and as its
    ``model-index`` (:func:`held_out_results`), and ``SHA256SUMS`` the card's new hash.
    ``with_results``: None, when its commit has them; True, or fail; False, never (the bytes exactly
    as dvc.lock records them)."""
    from dvc.repo.artifacts import Artifacts  # loads DVC's repo: only when fetching

    root = Path(root).resolve()
    if with_results and name != POLICY:
        raise PipelineError(
            f"--with-results adds the evaluate stage's results to the policy's card; {name}'s card already holds "
            "its held-out results (its stage wrote them). Fetch it without --with-results."
        )
    target = resolve(root, f"{name}#{stage}" if stage else f"{name}@{version or 'latest'}")
    out = Path(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.get-", dir=out.parent if out.parent.exists() else None))
    try:
        Artifacts.get(str(root), name, version=target.version, out=str(staging / "artifact"))
        fetched = staging / "artifact"
        recorded, found = recorded_hash(root, target), tree_md5(fetched)
        if found != recorded:  # DVC checks out its cache without re-reading it: a swapped object passes there
            raise DamagedArtifactError(
                f"{target.tag} as fetched is not what dvc.lock at its commit {target.commit[:12]} records: its files "
                f"digest to {found}, the lock records {recorded}. The DVC cache or remote holds other bytes under "
                "that hash; `rlhf lineage --verify` finds which. Nothing was written."
            )
        if not (fetched / CHECKSUMS).is_file():
            raise DamagedArtifactError(f"{target.tag} as fetched has no {CHECKSUMS}: its bytes cannot be checked.")
        problems = checksum_problems(fetched, read_checksums(fetched / CHECKSUMS))
        if problems:
            raise DamagedArtifactError(
                f"{target.tag} as fetched does not match its {CHECKSUMS}: {'; '.join(problems[:5])}"
            )
        wanted = name == POLICY and with_results is not False
        results = held_out_results(root, target, required=bool(with_results)) if wanted else []
        if results:
            add_held_out_results(
                fetched, results, f"`{paths.EVALUATION_METRICS}` at commit {target.commit[:12]} ({target.tag})"
            )
            write_checksums(fetched)  # the files were checked above; the card is the one that changed
        if out.exists():
            raise PipelineError(f"{out} exists: choose a new folder (nothing was written).")
        shutil.move(str(fetched), str(out))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = len(read_checksums(out / CHECKSUMS))
    return {
        "artifact": name,
        "version": target.version,
        "commit": target.commit,
        "out": str(out),
        "files_checked": files,
        "results": bool(results),
    }


# the policy's held-out results, as the evaluate stage measured them: (metric, name, type), in base-model stds
HELD_OUT_POLICY_RESULTS = (
    (keys.GOLD_GAIN, "gold reward gain over the base model (base-model stds)", "gold_gain"),
    (keys.PROXY_GAIN, "reward-model score gain over the base model (base-model stds)", "proxy_gain"),
    (keys.KL, "KL from the base model (nats per response)", "kl"),
    (keys.KL_EXACT, "KL from the base model, exact over the vocabulary (nats per response)", "kl_exact"),
    (keys.WIN_RATE_GOLD, "win rate against the base model (gold judge)", "win_rate"),
)


def held_out_results(root: str | Path, target: Version, required: bool = True) -> list:
    """The ``model-index`` entries of ``target``: what the evaluate stage measured on held-out queries at its
    commit (none there: [], or a PipelineError when ``required``)."""
    text = file_at(root, target.commit, paths.EVALUATION_METRICS)
    measured = json.loads(text) if text else {}
    results = [
        held_out_result(label, measured[key], "held-out queries", metric_type, task="text-generation")
        for key, label, metric_type in HELD_OUT_POLICY_RESULTS
        if isinstance(measured.get(key), (int, float))
    ]
    if not results and required:
        raise PipelineError(
            f"{target.tag}: its commit {target.commit[:12]} records no held-out results in {paths.EVALUATION_METRICS} "
            "(the evaluate stage had not run): nothing was written. Fetch it without --with-results."
        )
    return results


def assign_stage(root: str | Path, name: str, version: str, stage: str = PROD) -> Version:
    return assign(Path(root).resolve(), name, version, stage, message=f"assigned {stage} by hand (rlhf models assign)")
