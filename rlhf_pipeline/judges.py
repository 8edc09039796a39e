"""The gate's scorers: the challenger's reward model (the proxy) and the gold judge (a labeler, or a
frozen reward model in the project or in the registry), and one side-by-side comparison scored by them.

Loading a reward model loads torch and transformers: the gate imports this module only when it
compares, so listing and fetching versions start without them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline import paths
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.fetching import fetch
from rlhf_pipeline.io import CHECKSUMS, verify_checksums
from rlhf_pipeline.labelers import get_labeler
from rlhf_pipeline.modelcard import read_card
from rlhf_pipeline.params.promotion import REGISTERED_JUDGE, PromotionParams
from rlhf_pipeline.project_files import project_relative
from rlhf_pipeline.promotion import Comparison, Side, compare

SCORE_BATCH = 64


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


def compare_sides(root: Path, rule: PromotionParams, challenger: Side, incumbent: Side, kl: float | None) -> Comparison:
    """``challenger`` against ``incumbent``, query by query, scored by the challenger's reward model
    (the proxy) and by the gold judge ``promotion.*`` names (with what the frozen judge's card says it
    measured among the comparison's notes)."""
    with frozen_judge_folder(root, rule) as judge_folder:
        comparison = compare(
            challenger,
            incumbent,
            proxy=reward_scorer(root),
            judge=judge_scorer(root, rule, judge_folder),
            judge_name=rule.judge,
            kl=kl,
        )
        if (accuracy := judge_accuracy(rule, judge_folder)) is not None:
            comparison.notes.append(accuracy)
    return comparison
