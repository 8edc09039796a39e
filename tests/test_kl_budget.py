"""The KL budget's state and decisions, and the update's typed statistics, alone: no model, no trainer."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_pipeline.params.ppo import KLParams
from rlhf_pipeline.ppo.kl_budget import KLBudget
from rlhf_pipeline.ppo.stats import (
    LossStats,
    RolloutStats,
    UpdateTimes,
    gap_terms,
    history_summary,
    kl_reading,
    logprob_gap,
    mean_loss_stats,
    update_record,
)


class OneWeight:
    """A policy of one trainable weight whose KL is ``scale`` times its distance from 0."""

    def __init__(self, value: float, scale: float = 1.0):
        self.value, self.scale, self.reads = torch.tensor([value]), scale, []

    def weights(self):
        return {"w": self.value.clone()}

    def load(self, weights):
        self.value = weights["w"].clone()

    def read_kl(self, draw: int) -> float:
        self.reads.append(draw)
        return self.scale * self.value.item()


def budget(**kl) -> KLBudget:
    return KLBudget(KLParams(**{"budget": 5.0, "budget_window": 3, **kl}))


def records(kls: list[float]) -> list[dict]:
    return [{"update": u + 1, "objective/kl_exact": kl} for u, kl in enumerate(kls)]


def test_no_budget_is_inactive_and_keeps_no_state():
    none = KLBudget(KLParams())
    assert not none.active and none.state_dict() is None


def test_a_reading_is_wanted_when_the_trend_passes_the_budget_or_the_last_reading_was_close():
    kl = budget()
    assert not kl.wants_reading([0.0, 1.0, 2.0])  # the line says 3 after the next update
    assert kl.wants_reading([0.0, 2.0, 4.0])  # ... 6, over 5
    assert not kl.rolls_back([0.0, 2.0, 4.0], checked=3.0)  # the precise reading is lower: forecast 5, not over
    assert not kl.watching
    assert not kl.rolls_back([0.0, 2.0, 4.0], checked=4.5) and kl.watching  # forecast 6.5: watch the next one
    assert kl.wants_reading([0.0, 0.0, 0.0])  # watching, whatever the rollouts say
    assert kl.rolls_back([0.0, 2.0, 5.5], checked=5.5) and not kl.watching


def test_a_roll_back_without_a_line_search_restores_the_policy_before_the_update_and_drops_its_record():
    kl, policy = budget(budget_backtracks=0), OneWeight(6.0)
    kl.remember({"w": torch.tensor([4.0])})
    history = records([0.0, 2.0, 4.0])
    kept = kl.roll_back(2, 6.0, history, policy, policy.read_kl)
    assert policy.value.item() == 4.0 and kept.updates == 1 and kept.fraction is None
    assert kept.history == history[:1] and kl.discarded == history[1]
    assert kept.kl == 2.0  # the record of update 2 read the policy after update 1
    assert kl.stopped == {"updates": 1, "kl": 2.0, "rolled_back_kl": 6.0, "budget": 5.0}


def test_a_reading_over_the_budget_before_any_update_keeps_the_policy():
    kl, policy = budget(), OneWeight(6.0)
    kept = kl.roll_back(0, 6.0, [], policy, policy.read_kl)
    assert kept.updates == 0 and kept.kl == 6.0 and policy.value.item() == 6.0 and kl.discarded is None


@pytest.mark.parametrize(
    ("search", "fraction", "draws"),
    [("halve", 0.5, [1]), ("bisect", 0.75, [1, 1, 1])],  # KL along the step: 4 + 4f, budget 7
)
def test_the_line_search_keeps_part_of_the_step_and_the_policy_holds_it(search, fraction, draws):
    kl, policy = budget(budget=7.0, budget_backtracks=3, budget_search=search), OneWeight(8.0)
    kl.remember({"w": torch.tensor([4.0])})
    history = records([0.0, 3.0])
    kept = kl.roll_back(1, 8.0, history, policy, policy.read_kl)
    assert kept.fraction == fraction and kept.updates == 1 and kept.history == history
    assert policy.value.item() == pytest.approx(4.0 + 4.0 * fraction)  # loaded back after reading 7/8 over
    assert kept.kl == pytest.approx(4.0 + 4.0 * fraction) and policy.reads == draws
    assert kl.stopped["step_fraction"] == fraction and kl.discarded is None


def test_a_line_search_that_finds_nothing_within_falls_back_to_the_policy_before():
    kl, policy = budget(budget=1.0, budget_backtracks=2), OneWeight(8.0)
    kl.remember({"w": torch.tensor([4.0])})
    kept = kl.roll_back(1, 8.0, records([0.0, 3.0]), policy, policy.read_kl)
    assert kept.fraction is None and kept.updates == 0 and policy.value.item() == 4.0
    assert policy.reads == [1, 2]  # halving reads each try on a draw of its own


def test_the_state_round_trips_through_a_checkpoint():
    kl = budget()
    kl.remember({"w": torch.tensor([1.0])})
    kl.watching, kl.stopped = True, {"updates": 3}
    again = budget()
    again.load_state_dict(kl.state_dict())
    assert again.watching and again.stopped == {"updates": 3} and torch.equal(again.previous["w"], torch.tensor([1.0]))
    fresh = budget()
    fresh.load_state_dict(None)  # a checkpoint written without a budget
    assert not fresh.watching and fresh.previous is None


def test_the_record_names_every_statistic_in_the_order_history_json_has_always_had():
    loss = LossStats(
        policy=0.1, total=0.2, entropy=1.0, approxkl=0.01, clipfrac=0.1, ratio_mean=1.0, ratio_max=1.2, value=0.3
    )
    loss.value_clipfrac = 0.05
    record = update_record(
        update=1,
        batch_size=4,
        scores=torch.tensor([1.0, 2.0, 3.0, 4.0]),
        valid=torch.tensor([True, True, False, True]),
        response_lengths=torch.tensor([3, 3, 2, 4]),
        non_score=torch.full((4, 2), -0.5),
        values=torch.ones(4, 2),
        returns=torch.zeros(4, 2),
        mask=torch.ones(4, 2, dtype=torch.bool),
        rollout=RolloutStats(gold=0.5, kl_exact=1.5, kl_checked=1.25),
        loss=loss,
        lr=1e-5,
        mean_kl=1.5,
        kl_coef=0.2,
    )
    assert list(record) == [
        "update", "episodes", "objective/score", "objective/score_std", "objective/kl", "objective/kl_coef",
        "objective/non_score_reward", "objective/valid_fraction", "response/length", "val/mean", "returns/mean",
        "objective/gold", "objective/kl_exact", "objective/kl_checked", "loss/policy", "loss/total", "loss/value",
        "policy/approxkl", "policy/clipfrac", "policy/entropy", "policy/ratio_max", "policy/ratio_mean",
        "val/clipfrac", "lr",
    ]  # fmt: skip
    assert record["episodes"] == 8 and record["objective/valid_fraction"] == 0.75 and record["response/length"] == 3.0
    assert record["objective/non_score_reward"] == -1.0 and kl_reading(record) == 1.25
    json.dumps(record)  # what the checkpoint writes: plain numbers only


def test_loss_statistics_average_over_every_microbatch_of_every_process_and_take_the_largest_ratio():
    def stats(value: float) -> LossStats:
        return LossStats(
            policy=value, total=value, entropy=value, approxkl=value, clipfrac=value, ratio_mean=value, ratio_max=value
        )

    mine, theirs = [stats(1.0), stats(3.0)], [stats(8.0)]

    def gather(local):  # the other process's row: its sums and its microbatch count
        other = torch.tensor([[8.0] * 6 + [8.0] + [1.0]], dtype=torch.float64)
        return torch.cat([local, other])

    mean = mean_loss_stats(mine, gather, torch.device("cpu"))
    assert mean.policy == pytest.approx(4.0) and mean.ratio_max == 8.0 and mean.value is None
    assert mean_loss_stats(theirs, lambda rows: rows, torch.device("cpu")).policy == 8.0


def test_phase_times_add_up_piece_by_piece():
    total = UpdateTimes(generation=1.0, reference=2.0, scoring=3.0) + UpdateTimes(
        generation=0.5, reference=0.5, scoring=0.5
    )
    assert (total.generation, total.reference, total.scoring, total.training) == (1.5, 2.5, 3.5, 0.0)


def test_the_rollout_trainer_gap_is_the_largest_and_the_mean_token_difference_over_every_process():
    """|log pi_sample - log pi_train| over the kept tokens of the first minibatch's microbatches, pooled over the
    processes as the one-process run would pool them: the largest anywhere, the mean over every token."""
    sampled = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    trained = torch.tensor([[-1.0, -2.5, -9.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])  # the -9 is past the response: not counted
    terms = gap_terms(sampled, trained, mask)
    assert terms.tolist() == [0.5, 0.75, 5.0]
    other_process = torch.tensor([[1.0, 1.0, 2.0]], dtype=torch.float64)  # its one microbatch: 2 tokens, one off by 1
    gap = logprob_gap([terms, terms], lambda mine: torch.cat([mine, other_process]), torch.device("cpu"))
    assert gap == {"logprob_gap_max": 1.0, "logprob_gap_mean": pytest.approx(2.5 / 12)}
    assert logprob_gap([gap_terms(sampled, sampled, mask)], lambda mine: mine, torch.device("cpu")) == {
        "logprob_gap_max": 0.0,
        "logprob_gap_mean": 0.0,
    }
    assert logprob_gap([], lambda mine: mine, torch.device("cpu")) == {}
    history = [
        {"episodes": 8 * (u + 1), "objective/score": 0.0, "objective/kl": 1.0, "objective/kl_coef": 0.1}
        | {"policy/logprob_gap_max": top, "policy/logprob_gap_mean": mean}
        for u, (top, mean) in enumerate([(0.25, 0.01), (0.5, 0.03)])
    ]
    summary = history_summary(history, with_gold=False)
    assert summary["logprob_gap/max"] == 0.5 and summary["logprob_gap/mean"] == pytest.approx(0.02)
