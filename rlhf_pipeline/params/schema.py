"""The whole ``params.yaml``: every section joined into one :class:`Params`, with the rules that
span sections. ``rlhf check-params``, ``rlhf profile``, the retrain flow and the tests read the
file through it; a stage validates only the sections it declares (its own
:class:`~rlhf_pipeline.params.StageParams`), so this module is no stage's dependency.

Validation errors are rendered as ``dotted.key.path: what is wrong (got X)``, one per line; the
CLI and every stage exit 2 with those lines.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import model_validator

from rlhf_pipeline.params import Seed, Strict, read_params_file, refuse, validate
from rlhf_pipeline.params.base_model import BaseModelParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.evaluate import EvaluateParams
from rlhf_pipeline.params.labelling import LABEL_FILE_SUFFIXES, LABEL_STUDIO, SIMULATED_LABELS, LabellingParams
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.promotion import PromotionParams
from rlhf_pipeline.params.reward import RewardParams
from rlhf_pipeline.params.schedule import ScheduleParams
from rlhf_pipeline.params.task import TaskParams


class Params(Strict):
    seed: Seed = 1
    compute: ComputeParams = ComputeParams()
    base_model: BaseModelParams = BaseModelParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    reward: RewardParams = RewardParams()
    ppo: PPOParams = PPOParams()
    evaluate: EvaluateParams = EvaluateParams()
    schedule: ScheduleParams = ScheduleParams()
    promotion: PromotionParams = PromotionParams()
    labelling: LabellingParams = LabellingParams()

    @model_validator(mode="after")
    def _sections_agree(self) -> Params:
        problems: list[tuple[str, str, Any]] = []
        batch_size = self.reward.train.batch_size
        if self.data.preferences.num_labels < batch_size:
            problems.append(
                (
                    "data.preferences.num_labels",
                    f"must be >= reward.train.batch_size ({batch_size})",
                    self.data.preferences.num_labels,
                )
            )
        labelling = self.labelling
        labels = self.data.preferences.source
        if labelling.source != SIMULATED_LABELS and not labels.endswith(LABEL_FILE_SUFFIXES):
            problems.append(
                (
                    "data.preferences.source",
                    f"must be the .jsonl or .parquet file in this project that a run brings labels into when "
                    f"labelling.source is {labelling.source} (e.g. data/labels/human.jsonl)",
                    labels,
                )
            )
        golden = self.promotion.golden_labels
        if golden is not None and labelling.source != SIMULATED_LABELS and labels == golden:
            problems.append(
                (
                    "data.preferences.source",
                    "is promotion.golden_labels, the golden set a frozen judge is trained and measured on: no retrain "
                    "run may write to it; bring each round's labels into another file",
                    labels,
                )
            )
        if labelling.source == LABEL_STUDIO and labelling.label_studio_project is None:
            problems.append(
                ("labelling.label_studio_project", "must name the project to pull when source is label_studio", None)
            )
        refuse(problems)
        return self


def parse_params(raw: Any, path: str = "params.yaml") -> Params:
    return validate(Params, raw, path)


def load_params(path: str | os.PathLike = "params.yaml") -> Params:
    return parse_params(read_params_file(path), str(path))
