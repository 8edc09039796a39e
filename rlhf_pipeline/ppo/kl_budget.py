"""``ppo.kl.budget``: keep the last policy whose KL to the reference is within the budget.

The budget watches each rollout's mean exact KL. When their trend says the next update may pass the
budget (:func:`~rlhf_pipeline.ppo.kl.kl_forecast`), or the last precise reading was close to it, the
policy's KL is read precisely (over more responses than a rollout's); the first policy read over the
budget ends the run (:func:`~rlhf_pipeline.ppo.kl.kl_budget_verdict`). It is rolled back part of its last
update's way (``kl.budget_backtracks`` tries of a line search, each read precisely) or, when none of
those is within the budget, to the policy before that update.

:class:`KLBudget` holds the budget's state (whether it is watching, the weights before the last update,
where it stopped the run, the record of the update it undid) and makes its decisions; the trainer hands
it the policy's weights and a way to read the policy's KL (:class:`BudgetPolicy`), so it is tested alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from rlhf_pipeline.params.ppo import KLParams
from rlhf_pipeline.ppo.kl import budget_line_search, kl_budget_verdict, kl_forecast
from rlhf_pipeline.ppo.stats import kl_reading

Weights = dict[str, Tensor]


class BudgetPolicy(Protocol):
    """What the budget needs of the policy: its trainable weights, to read and to set."""

    def weights(self) -> Weights: ...

    def load(self, weights: Weights) -> None: ...


@dataclass(frozen=True)
class RolledBack:
    """Where the budget ended the run: ``history`` is the records to keep (the undone update's is gone),
    ``updates`` the update count of the kept policy, ``fraction`` of its last update's step when the line
    search kept part of it, and ``kl`` the kept policy's KL."""

    history: list[dict]
    updates: int
    kl: float
    fraction: float | None


class KLBudget:
    def __init__(self, cfg: KLParams):
        self.cfg = cfg
        self.watching = False  # the last precise reading was close: read the next policy too
        self.previous: Weights | None = None  # the trainable weights before the last update
        self.stopped: dict | None = None  # where the budget ended the run (the stage's metric), once it has
        self.discarded: dict | None = None  # the record of the update a roll-back undid (logged, not kept)

    @property
    def active(self) -> bool:
        return self.cfg.budget is not None

    def wants_reading(self, kls: list[float]) -> bool:
        """Whether the current policy's KL is to be read precisely (``kls``: every policy's KL so far, the
        current rollout's last): it is being watched, or the trend passes the budget at the next update."""
        return self.watching or kl_forecast(kls, self.cfg.budget_window) > self.cfg.budget

    def rolls_back(self, kls: list[float], checked: float) -> bool:
        """Whether the current policy, read at ``checked``, ends the run; else whether to watch the next."""
        verdict = kl_budget_verdict(kls, checked, self.cfg.budget, self.cfg.budget_window)
        self.watching = verdict == "watch"
        return verdict == "roll back"

    def remember(self, weights: Weights) -> None:
        """The weights before an update: what a reading over the budget rolls back to."""
        self.previous = weights

    def line_search(self, policy: BudgetPolicy, read_kl: Callable[[int], float]) -> tuple[float, float] | None:
        """``kl.budget_backtracks`` tries of policies part of the last update's way from the one before it,
        each read by ``read_kl(draw)``, the fractions chosen by ``kl.budget_search``
        (:func:`~rlhf_pipeline.ppo.kl.budget_line_search`): (fraction, KL) of the one kept, whose weights
        the policy then holds; None when none is within the budget (the policy is then the one after the
        update)."""
        cfg, before = self.cfg, self.previous
        if not cfg.budget_backtracks or before is None:
            return None
        after = policy.weights()

        def load(fraction: float) -> None:
            policy.load({name: before[name] + fraction * (after[name] - before[name]) for name in after})

        readings: dict[float, float] = {}

        def within(fraction: float) -> bool:
            load(fraction)
            # bisection reads every fraction on one draw (the same queries and generator seed): where it
            # puts the boundary between within and over is then the step's, not the samples'; halving
            # reads each try on a draw of its own
            draw = 1 if cfg.budget_search == "bisect" else len(readings) + 1
            readings[fraction] = read_kl(draw)
            return readings[fraction] <= cfg.budget

        kept = budget_line_search(within, cfg.budget_backtracks, cfg.budget_search)
        if kept is None:
            policy.load(after)
            return None
        if kept != list(readings)[-1]:  # bisection read further along after it: back to the kept fraction
            load(kept)
        return kept, readings[kept]

    def roll_back(
        self, update: int, checked: float, history: list[dict], policy: BudgetPolicy, read_kl: Callable[[int], float]
    ) -> RolledBack:
        """End the run with a policy within the budget (``checked``: the KL the one after update ``update``
        was read at, over it; ``history``: the records so far): part of the way back (:meth:`line_search`),
        else the policy before the update, which ``policy`` then holds."""
        within = self.line_search(policy, read_kl)
        if within is not None:  # the undone part of the update is a fraction of its step, not its record
            fraction, kept_kl = within
            kept = update
            self.stopped = {"updates": kept, "step_fraction": fraction, "kl": kept_kl}
        else:
            fraction = None
            kept = update - 1 if self.previous is not None else update  # no update yet: nothing to go back to
            if self.previous is not None:
                policy.load(self.previous)
                kept_kl = kl_reading(history[kept])  # the record of update `kept + 1` read the kept policy
                history, self.discarded = history[:kept], history[kept]
            else:
                kept_kl = checked
            self.stopped = {"updates": kept, "kl": kept_kl}
        self.stopped |= {"rolled_back_kl": checked, "budget": self.cfg.budget}
        return RolledBack(history=history, updates=kept, kl=kept_kl, fraction=fraction)

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the budget (None without one), so a resumed run decides the same."""
        if not self.active:
            return None
        return {
            "watching": self.watching,
            "previous": self.previous,
            "stopped": self.stopped,
            "discarded": self.discarded,
        }

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.watching, self.previous = state.get("watching", False), state.get("previous")
        self.stopped, self.discarded = state.get("stopped"), state.get("discarded")
