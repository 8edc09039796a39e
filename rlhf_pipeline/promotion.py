"""The promotion gate: does a retrained policy (the challenger) replace the version assigned
``prod`` (the incumbent)? Champion/challenger on the same held-out queries, by the rule in
``promotion.*``.

Both sides are read from ``evaluation/responses.jsonl`` (every held-out query with the base's and
the policy's response, k rows for a query answered k times: ``evaluate.responses_per_query``), the
challenger's from the workspace, the incumbent's from git at its version's commit; the first version,
with no ``prod`` yet, meets the base model's responses in the challenger's own file. The two sides are
paired by query (a query's j-th responses together) and scored the same way:

- gold: the judge (``promotion.judge``) scores each response text, apart from where the labels
  came from, so a round of bad labels cannot vouch for itself;
- proxy: the challenger's reward model scores both sides' texts;
- KL: the challenger's KL to the base, from its evaluation (the exact KL, :func:`limit_kl`).

The rule: promote when the challenger is worse than the incumbent by at most
``tolerance_se`` paired standard errors (on gold, or proxy), its KL is within ``max_kl``, and at
least ``min_queries`` queries pair up. Where a judge scored both sides, the decision shows the
proxy gain beside the judged gain, and a proxy gain beyond the tolerance with a judged loss beyond it
is reported as reward hacking and not promoted. A rejected challenger is a result, not a failure.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from rlhf_pipeline import metric_keys as keys
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.params.promotion import PromotionParams

Scorer = Callable[[list[str], list[str]], list[float]]  # (queries, responses) -> one score each


@dataclass(frozen=True)
class Paired:
    r"""The mean paired difference of the challenger over the incumbent and its standard error.

    .. math::
        \bar d = \frac1n \sum_i d_i,\qquad \mathrm{SE}(\bar d) = \frac{\mathrm{sd}(d_i)}{\sqrt n},\qquad
        d_i = \frac1{k_i} \sum_j (c_{ij} - p_{ij})

    over n queries, query i answered k_i times by each side (``evaluate.responses_per_query``), with ``sd``
    the sample std (n - 1): pairing removes the between-query variance, and averaging a query's responses
    first keeps the error over queries (one query's responses are not independent draws of the test set)."""

    mean: float
    stderr: float
    n: int

    @property
    def in_se(self) -> float | None:
        """The difference in standard errors (None when the two sides never differ)."""
        return self.mean / self.stderr if self.stderr > 0 else None


def paired(challenger: Sequence[float], incumbent: Sequence[float], queries: Sequence[str] | None = None) -> Paired:
    """:class:`Paired` of two score lists, row i of each answering ``queries[i]`` (rows of one query are
    averaged first); every row its own query when ``queries`` is None."""
    c, p = np.asarray(challenger, dtype=float), np.asarray(incumbent, dtype=float)
    if c.shape != p.shape or (queries is not None and len(queries) != c.size):
        raise ValueError("paired needs two score lists of the same length, and a query for each row")
    d = c - p
    if queries is not None:
        first_seen: dict[str, int] = {}
        group = np.asarray([first_seen.setdefault(query, len(first_seen)) for query in queries], dtype=np.int64)
        d = np.bincount(group, weights=d) / np.bincount(group)
    if d.size < 2:
        raise ValueError("paired needs at least 2 queries")
    return Paired(mean=float(d.mean()), stderr=float(d.std(ddof=1) / np.sqrt(d.size)), n=int(d.size))


@dataclass(frozen=True)
class Tally:
    r"""The challenger's win rate over the incumbent from people's verdicts, ties weighted:

    .. math::
        \hat p = \frac{w + \tau t}{n}

    with ``w`` wins, ``t`` ties, ``n`` answers, and its Wilson score interval at ``confidence``
    (:func:`wilson`)."""

    wins: int
    ties: int
    losses: int
    tie_weight: float
    confidence: float
    annotators: dict[str, int]  # answers per person

    @property
    def n(self) -> int:
        return self.wins + self.ties + self.losses

    @property
    def win_rate(self) -> float:
        return (self.wins + self.tie_weight * self.ties) / self.n if self.n else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.win_rate, self.n, self.confidence)


def wilson(p: float, n: int, confidence: float) -> tuple[float, float]:
    r"""Wilson's score interval for a binomial proportion ``p`` observed over ``n`` trials:

    .. math::
        \frac{\hat p + \frac{z^2}{2n} \pm z\sqrt{\frac{\hat p(1-\hat p)}{n} + \frac{z^2}{4n^2}}}{1 + \frac{z^2}{n}}

    with ``z`` the normal quantile of ``(1 + confidence) / 2``; it stays in [0, 1] and is honest at
    small ``n`` and at ``p`` near 0 or 1, where the normal interval is not."""
    if n <= 0:
        return (0.0, 1.0)
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class Side:
    """One policy's responses to the held-out queries."""

    label: str  # "policy@v3", "base model"
    queries: list[str]
    responses: list[str]


@dataclass
class Comparison:
    challenger: str
    incumbent: str
    queries: int  # paired held-out queries
    gold: Paired | None
    proxy: Paired
    kl: float | None  # the challenger's KL to the base (nats)
    judge: str | None
    notes: list[str] = field(default_factory=list)
    human: Tally | None = None  # people's side-by-side verdicts, where a round was answered


@dataclass
class Decision:
    promote: bool
    score: str  # what the rule compared: gold, proxy or human
    reasons: list[str]
    comparison: Comparison
    rule: dict[str, Any]
    reward_hacking: bool = False  # the proxy gained beyond tolerance while the judge lost beyond it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def limit_kl(metrics: dict[str, Any]) -> float | None:
    """The KL (nats) that ``max_kl`` judges, from an evaluation's metrics: its exact KL (each token's term
    over the whole vocabulary, a fraction of k1's standard error), or ``kl/mean`` in an evaluation from
    before the exact one was measured; None when neither is there."""
    for key in (keys.KL_EXACT, keys.KL):
        if isinstance(metrics.get(key), (int, float)):
            return float(metrics[key])
    return None


def read_responses(text: str, where: str) -> list[dict[str, Any]]:
    """The rows of an ``evaluation/responses.jsonl`` text (``where`` names it in errors)."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise PipelineError(f"{where}, line {number}: not JSON ({error}); rerun `dvc repro evaluate`.") from None
        if not isinstance(row, dict) or not {"query", "policy_response", "base_response"} <= set(row):
            raise PipelineError(
                f"{where}, line {number}: not an evaluation row (query, base_response, policy_response)."
            )
        rows.append(row)
    if not rows:
        raise PipelineError(f"{where} holds no rows; rerun `dvc repro evaluate`.")
    return rows


def pair_sides(challenger: Side, incumbent: Side) -> tuple[Side, Side]:
    """The two sides restricted to the queries both answered, in the challenger's order (a query
    text seen k times pairs its k-th occurrences)."""

    def keyed(side: Side) -> dict[tuple[str, int], str]:
        seen: Counter[str] = Counter()
        out = {}
        for query, response in zip(side.queries, side.responses):
            out[(query, seen[query])] = response
            seen[query] += 1
        return out

    mine, theirs = keyed(challenger), keyed(incumbent)
    common = [key for key in mine if key in theirs]
    return (
        Side(challenger.label, [q for q, _ in common], [mine[k] for k in common]),
        Side(incumbent.label, [q for q, _ in common], [theirs[k] for k in common]),
    )


def compare(
    challenger: Side, incumbent: Side, proxy: Scorer, judge: Scorer | None, judge_name: str | None, kl: float | None
) -> Comparison:
    """Score both sides the same way on the queries they share."""
    c, p = pair_sides(challenger, incumbent)
    notes = []
    if len(c.queries) < len(challenger.queries):
        notes.append(
            f"{len(challenger.queries) - len(c.queries)} of the challenger's {len(challenger.queries)} responses to "
            f"held-out queries have no counterpart from {incumbent.label} (the held-out queries, or "
            "evaluate.responses_per_query, changed): compared on the rest"
        )
    queries = len(set(c.queries))  # a query answered k times (evaluate.responses_per_query) counts once
    if queries < 2:
        return Comparison(challenger.label, incumbent.label, queries, None, Paired(0.0, 0.0, 0), kl, judge_name, notes)
    gold = paired(judge(c.queries, c.responses), judge(p.queries, p.responses), c.queries) if judge else None
    proxy_diff = paired(proxy(c.queries, c.responses), proxy(p.queries, p.responses), c.queries)
    return Comparison(challenger.label, incumbent.label, queries, gold, proxy_diff, kl, judge_name, notes)


def decide(comparison: Comparison, rule: PromotionParams) -> Decision:
    """Apply ``rule`` (see the module doc) to ``comparison``."""
    reasons, promote = [], True
    score = rule.score
    if score == "gold" and comparison.gold is None:
        score = "proxy"
        reasons.append("no gold judge (promotion.judge is null): the rule compares proxy")
    if score == "human":
        promote = _human_rule(comparison, rule, reasons)
    elif comparison.queries < rule.min_queries:
        promote = False
        reasons.append(
            f"only {comparison.queries} held-out queries pair up (promotion.min_queries: {rule.min_queries})"
        )
    else:
        diff = comparison.gold if score == "gold" else comparison.proxy
        floor = -rule.tolerance_se * diff.stderr
        verdict = "within" if diff.mean >= floor else "beyond"
        reasons.append(
            f"{score}: challenger - {comparison.incumbent} = {diff.mean:+.4f} ± {diff.stderr:.4f} (paired SE, "
            f"n={diff.n}); the floor is -{rule.tolerance_se:g} SE = {floor:+.4f}: {verdict} tolerance"
        )
        promote = promote and diff.mean >= floor
    hacking = reward_hacking(comparison, rule.tolerance_se)
    if hacking:
        promote = False
        reasons.append(
            f"reward hacking: the challenger's own reward model puts it {comparison.proxy.in_se:+.1f} SE above "
            f"{comparison.incumbent}, {_judged(comparison)}: it learnt what its labels' reward model rewards, "
            "not what the judge does"
        )
    if rule.max_kl is not None:
        if comparison.kl is None:
            promote = False
            reasons.append(
                "the challenger's KL to the base is unknown (metrics/evaluate.json has neither kl/exact_mean nor "
                "kl/mean)"
            )
        else:
            within = comparison.kl <= rule.max_kl
            reasons.append(f"KL to the base {comparison.kl:.3f} {'<=' if within else '>'} max_kl {rule.max_kl:g}")
            promote = promote and within
    return Decision(promote, score, reasons, comparison, rule.model_dump(), hacking)


def human_shortfall(tally: Tally | None, rule: PromotionParams) -> str | None:
    """Why people's verdicts are too few to decide on (fewer than ``promotion.human.min_judgements``
    answers, or from fewer than ``min_annotators`` people); None when they suffice."""
    wanted = rule.human
    if tally is None:
        return "no side-by-side verdicts yet"
    if tally.n < wanted.min_judgements or len(tally.annotators) < wanted.min_annotators:
        return (
            f"{tally.n} verdict{'' if tally.n == 1 else 's'} from {_people(len(tally.annotators))}; the rule needs "
            f"at least {wanted.min_judgements} from at least {wanted.min_annotators} (promotion.human)"
        )
    return None


def _people(count: int) -> str:
    return f"{count} {'person' if count == 1 else 'people'}"


def _human_rule(comparison: Comparison, rule: PromotionParams, reasons: list[str]) -> bool:
    """promotion.score: human: the challenger's win rate's interval must reach 50 %."""
    tally = comparison.human
    if (short := human_shortfall(tally, rule)) is not None:
        reasons.append(f"human: {short}")
        return False
    low, high = tally.interval
    verdict = "reaches" if high >= 0.5 else "stays below"
    reasons.append(
        f"human: the challenger wins {tally.win_rate:.1%} of {tally.n} side-by-side verdicts against "
        f"{comparison.incumbent} ({tally.wins} wins, {tally.ties} ties at {tally.tie_weight:g}, {tally.losses} "
        f"losses; {_people(len(tally.annotators))}); its {tally.confidence:.0%} interval {low:.1%} to {high:.1%} "
        f"{verdict} 50%: {'within' if high >= 0.5 else 'beyond'} tolerance"
    )
    return high >= 0.5


def reward_hacking(comparison: Comparison, tolerance_se: float) -> bool:
    """A proxy gain beyond ``tolerance_se`` paired SEs with a judged loss beyond as many (or, judged by
    people, a win rate whose interval stays below 50 %): the gap between what the challenger's reward
    model says and what the judge says, where it matters."""
    gold, proxy, human = comparison.gold, comparison.proxy, comparison.human
    if not proxy.n or proxy.mean <= tolerance_se * proxy.stderr:
        return False
    if human is not None and human.n and human.interval[1] < 0.5:
        return True
    return gold is not None and bool(gold.n) and gold.mean < -tolerance_se * gold.stderr


def _judged(comparison: Comparison) -> str:
    """The judged loss, in words, for a reward-hacking reason."""
    human = comparison.human
    if human is not None and human.n and human.interval[1] < 0.5:
        return (
            f"while people prefer it in {human.win_rate:.0%} of {human.n} side-by-side verdicts (its interval reaches "
            f"{human.interval[1]:.0%}, below 50%)"
        )
    return f"the judge ({comparison.judge}) {comparison.gold.in_se:+.1f} SE below"


def render(decision: Decision, registered: str, outcome: str) -> str:
    """The decision as markdown (the retrain flow's ``promotion-decision`` artifact)."""
    c = decision.comparison
    verdict = "promoted to prod" if decision.promote else "not promoted: prod is unchanged"
    lines = [f"# Promotion gate: {c.challenger} {verdict}", "", f"- Registered: {registered}", f"- {outcome}"]
    lines += [f"- Compared with: {c.incumbent}, on {c.queries} paired held-out queries", ""]
    lines += ["| score | challenger - incumbent | paired SE | in SE |", "|---|---|---|---|"]
    for name, diff in (("gold (" + (c.judge or "none") + ")", c.gold), ("proxy (challenger's RM)", c.proxy)):
        if diff is not None and diff.n:
            in_se = f"{diff.in_se:+.2f}" if diff.in_se is not None else "n/a"
            lines.append(f"| {name} | {diff.mean:+.4f} | {diff.stderr:.4f} | {in_se} |")
    lines.append(
        f"| KL to the base (nats) | {c.kl:.3f} | | |" if c.kl is not None else "| KL to the base | unknown | | |"
    )
    if c.human is not None and c.human.n:
        h, (low, high) = c.human, c.human.interval
        lines += [
            "",
            f"| people, side by side | verdicts | wins | ties | losses | win rate | {h.confidence:.0%} interval |",
            "|---|---|---|---|---|---|---|",
            f"| challenger vs {c.incumbent} | {h.n} | {h.wins} | {h.ties} | {h.losses} | {h.win_rate:.1%} | "
            f"{low:.1%} to {high:.1%} |",
            "",
            "- Each person's share of the verdicts: "
            + ", ".join(f"{who} {count} ({count / h.n:.0%})" for who, count in h.annotators.items()),
        ]
    if c.gold is not None and c.gold.n and c.gold.in_se is not None and c.proxy.in_se is not None:
        lines += [
            "",
            f"- Proxy-judge gap: the challenger's own reward model puts it {c.proxy.in_se:+.1f} SE from "
            f"{c.incumbent}, the judge {c.gold.in_se:+.1f} SE.",
        ]
    if c.human is not None and c.human.n and c.proxy.n and c.proxy.in_se is not None:
        lines.append(
            f"- Proxy-people gap: the challenger's own reward model puts it {c.proxy.in_se:+.1f} SE from "
            f"{c.incumbent}; people prefer it in {c.human.win_rate:.0%} of {c.human.n} verdicts."
        )
    if decision.reward_hacking:
        lines.append(
            "- **Reward hacking**: the proxy gain is the reward model's, not the judge's; the labels or the reward "
            "model this round trained are suspect."
        )
    lines += ["", f"## Rule (`promotion.*`, compared on {decision.score})", ""]
    lines += [f"- {reason}" for reason in [*decision.reasons, *c.notes]]
    return "\n".join(lines) + "\n"
