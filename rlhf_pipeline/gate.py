"""The promotion gate (`rlhf models gate`): register HEAD's policy (and reward model), and decide
whether it takes ``prod``.

The gate reads the decision's inputs (the evaluate stage's responses and metrics, prod's responses at
its commit, the scores of :mod:`rlhf_pipeline.judges`, a side-by-side round's verdicts) and writes the
registration and the decision, with the rule of :mod:`rlhf_pipeline.promotion`. The work a human
decision waits on is not the gate's: a round is sampled and sent by `rlhf label compare --send`, its
answers pulled by `rlhf label verdicts --from-server`, and the retrain flow runs both as tasks
(flows/retrain/rounds.py) around this command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline import paths
from rlhf_pipeline.errors import DataContractError, PipelineError, plain
from rlhf_pipeline.params.promotion import PromotionParams
from rlhf_pipeline.params.schema import Params, load_params
from rlhf_pipeline.promotion import Decision, Side, Tally, decide, human_shortfall, limit_kl, read_responses, render
from rlhf_pipeline.registry import (
    POLICY,
    PROD,
    REWARD_MODEL,
    Version,
    assign,
    declared_artifacts,
    in_stage,
    recorded_file,
    register,
    require_recorded_run,
    version_of,
)
from rlhf_pipeline.side_by_side import commit_round, load_round, round_path, rounds_lock
from rlhf_pipeline.side_by_side import tally as side_by_side_tally


@dataclass(frozen=True)
class WantedRound:
    """The side-by-side round a registered challenger waits for (``promotion.score: human``)."""

    challenger: str  # the challenger version's tag
    incumbent: str  # prod's tag, or the base model's folder before any version took prod
    path: Path  # the round's file (side_by_side/CHALLENGER_vs_INCUMBENT.json)
    project: int | None  # promotion.human.label_studio_project: where its tasks go, None for files

    @property
    def sampled(self) -> bool:
        return self.path.is_file()

    def as_dict(self, root: Path) -> dict[str, Any]:
        return {
            "challenger": self.challenger,
            "incumbent": self.incumbent,
            "file": str(self.path.relative_to(root)),
            "sampled": self.sampled,
            "project": self.project,
        }


def wanted_round(root: Path, params: Params, challenger: Version, prod: Version | None) -> WantedRound:
    incumbent = prod.tag if prod is not None else paths.BASE_MODEL
    path = round_path(root, challenger.tag, incumbent)
    return WantedRound(challenger.tag, incumbent, path, params.promotion.human.label_studio_project)


def waiting_round(root: str | Path, params: Params) -> WantedRound | None:
    """The round HEAD's policy waits for: registered by an earlier gate, not prod, and decided by
    people (``promotion.score: human``); None otherwise. The retrain flow pulls its answers before the
    gate counts them."""
    root = Path(root).resolve()
    if params.promotion.score != "human" or POLICY not in declared_artifacts(root):
        return None
    challenger, _, _ = version_of(root, POLICY)
    if challenger is None or PROD in challenger.stages:
        return None
    return wanted_round(root, params, challenger, in_stage(root, POLICY, PROD))


def evaluated_sides(root: Path) -> tuple[Side, Side, float | None]:
    """HEAD's policy and the base model as the evaluate stage had them answer the held-out queries,
    and the KL the rule judges."""
    responses = root / paths.EVALUATION_RESPONSES
    if not responses.is_file():
        raise PipelineError(f"{responses} is missing: run `dvc repro evaluate` (and commit) before the gate.")
    rows = read_responses(responses.read_text(), str(responses))
    evaluated = root / paths.EVALUATION_METRICS
    metrics = json.loads(evaluated.read_text()) if evaluated.is_file() else {}
    queries = [r["query"] for r in rows]
    policy = Side("HEAD's policy", queries, [r["policy_response"] for r in rows])
    return policy, Side("base model", queries, [r["base_response"] for r in rows]), limit_kl(metrics)


def incumbent_side(root: str | Path, base: Side) -> tuple[Side, Version | None]:
    """What the challenger meets: the version assigned prod, else the ``base`` model (first version)."""
    prod = in_stage(root, POLICY, PROD)
    if prod is None:
        return base, None
    text = recorded_file(root, prod, paths.EVALUATION_RESPONSES)
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
    challenger_side, base, kl = evaluated_sides(root)
    incumbent, prod = incumbent_side(root, base)
    from rlhf_pipeline.judges import compare_sides  # loads torch and transformers: only when the gate compares

    comparison = compare_sides(root, rule, challenger_side, incumbent, kl)
    challenger, reward = register_run(root)
    comparison.challenger = challenger.tag
    registered = challenger.tag + (f", {reward.tag}" if reward is not None else "")
    if rule.score == "human":
        wanted = wanted_round(root, params, challenger, prod)
        comparison.human, waits = human_tally(root, rule, wanted)
        if waits is not None:
            return {
                "decision": None,
                "registered": registered,
                "outcome": waits,
                "markdown": "",
                "waiting": True,
                "round": wanted.as_dict(root),
            }
    decision = decide(comparison, rule)
    outcome = assign_if_promoted(root, decision, challenger, reward, prod)
    return {
        "decision": decision.as_dict(),
        "registered": registered,
        "outcome": outcome,
        "markdown": render(decision, registered, outcome),
    }


def register_run(root: Path) -> tuple[Version, Version | None]:
    """HEAD's policy registered (and its reward model, where dvc.yaml declares one)."""
    challenger, _ = register(root, POLICY, message="retrain: a new policy")
    if REWARD_MODEL not in declared_artifacts(root):
        return challenger, None
    return challenger, register(root, REWARD_MODEL, message="retrain: a new reward model")[0]


def assign_if_promoted(
    root: Path, decision: Decision, challenger: Version, reward: Version | None, prod: Version | None
) -> str:
    """``prod`` to the challenger (and its reward model) when the rule promotes it; what happened."""
    if not decision.promote:
        return f"prod stays {prod.tag if prod else 'unassigned'}; {challenger.tag} is registered, not promoted"
    assign(root, POLICY, challenger.version, PROD, message=f"promotion gate: {challenger.tag} passed")
    if reward is None:
        return f"{challenger.tag} assigned prod"
    assign(root, REWARD_MODEL, reward.version, PROD, message=f"promotion gate: with {challenger.tag}")
    return f"{challenger.tag} assigned prod (with {reward.tag})"


def human_tally(root: Path, rule: PromotionParams, wanted: WantedRound) -> tuple[Tally | None, str | None]:
    """People's verdicts on ``wanted``'s challenger against its incumbent, as its round file holds them
    (committed as it stands: a decision people made is audited like the version it decides on), and
    why the gate waits, or None."""
    if not wanted.sampled:
        return None, round_to_sample(wanted)
    with rounds_lock(root):  # the round counted is the round committed, whatever a pull writes meanwhile
        commit_round(root, wanted.path)
        record = load_round(wanted.path, root)  # sealed, and every verdict one person's one answer to a task of it
    if (record.challenger, record.incumbent) != (wanted.challenger, wanted.incumbent):
        raise DataContractError(
            f"{wanted.path}: the round compares {plain(record.challenger, 80)} with {plain(record.incumbent, 80)}, "
            f"not {wanted.challenger} with {wanted.incumbent}: its file was renamed or copied. Restore it from git; "
            "nothing was counted."
        )
    tally = side_by_side_tally(record.verdicts, rule.human.tie_weight, rule.human.confidence)
    short = human_shortfall(tally, rule)
    if short is None:
        return tally, None
    pull = "" if wanted.project is None else f"; `rlhf label verdicts --from-server {wanted.project}` pulls newer ones"
    return tally, f"{wanted.challenger} is registered and waits: {short}, against {wanted.incumbent}{pull}"


def round_to_sample(wanted: WantedRound) -> str:
    """Why the gate waits when ``wanted`` has no round yet, and what makes one."""
    waits = (
        f"{wanted.challenger} is registered and waits for people's side-by-side verdicts against {wanted.incumbent}: "
    )
    if wanted.project is None:
        return waits + (
            f"`rlhf label compare {wanted.challenger} {wanted.incumbent} tasks.json`, import tasks.json into a Label "
            "Studio project whose interface is `rlhf label config --side-by-side`, then `rlhf label verdicts "
            "EXPORT.json` with its export, and run `rlhf models gate` again"
        )
    return waits + (
        f"its round goes to Label Studio project {wanted.project} (`rlhf label compare {wanted.challenger} "
        f"{wanted.incumbent} --send {wanted.project}`; the retrain flow sends it after this gate), and the answers "
        f"come back with `rlhf label verdicts --from-server {wanted.project}` (the flow pulls them before the next "
        "gate)"
    )
