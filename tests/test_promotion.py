"""The promotion gate's rule on numbers (rlhf_pipeline/promotion.py): paired differences, the
thresholds, pairing by query, and the proxy-judge gap reported as reward hacking. The gate on a real
project: tests/test_registry.py."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf_pipeline.params.promotion import PromotionParams
from rlhf_pipeline.promotion import (
    Comparison,
    Paired,
    Side,
    Tally,
    compare,
    decide,
    human_shortfall,
    paired,
    render,
    wilson,
)


# --------------------------------------------------------------------------------------------
def test_paired_difference_and_its_standard_error():
    result = paired([3.0, 5.0, 4.0, 8.0], [1.0, 2.0, 2.0, 3.0])  # d = 2, 3, 2, 5
    assert result.mean == pytest.approx(3.0)
    assert result.stderr == pytest.approx((2.0 / 4) ** 0.5)  # sd(d) = sqrt(2) (n - 1), / sqrt(4)
    assert result.n == 4 and result.in_se == pytest.approx(3.0 / (0.5**0.5))


def _comparison(gold_mean: float, kl: float | None = 4.0, n: int = 64) -> Comparison:
    return Comparison(
        "policy@v2.0.0", "policy@v1.0.0", n, Paired(gold_mean, 0.01, n), Paired(0.5, 0.02, n), kl, "vader"
    )


@pytest.mark.parametrize(
    ("gold_mean", "kl", "rule", "promote"),
    [
        (-0.019, 4.0, {}, True),  # within 2 SE below prod
        (-0.021, 4.0, {}, False),  # beyond
        (-0.021, 4.0, {"tolerance_se": 3.0}, True),
        (0.30, 11.0, {}, False),  # better, but past the KL budget
        (0.30, 11.0, {"max_kl": None}, True),
        (0.30, None, {}, False),  # a KL nobody measured is no KL within budget
    ],
)
def test_the_rule_promotes_by_its_thresholds(gold_mean, kl, rule, promote):
    decision = decide(_comparison(gold_mean, kl), PromotionParams(**rule))
    assert decision.promote is promote, decision.reasons
    assert decision.score == "gold"


def test_the_kl_limit_judges_the_exact_kl_where_the_evaluation_measured_it():
    from rlhf_pipeline.promotion import limit_kl

    assert limit_kl({"kl/mean": 6.3, "kl/exact_mean": 5.9}) == 5.9  # the precise one
    assert limit_kl({"kl/mean": 6.3}) == 6.3  # an evaluation from before the exact KL
    assert limit_kl({"kl/mean": None, "kl/exact_mean": None}) is None and limit_kl({}) is None
    decision = decide(_comparison(0.3, limit_kl({"kl/mean": 6.3, "kl/exact_mean": 5.9})), PromotionParams(max_kl=6.0))
    assert decision.promote and "KL to the base 5.900 <= max_kl 6" in decision.reasons


def test_without_a_judge_the_rule_compares_proxy_and_says_so():
    comparison = _comparison(-5.0)
    comparison.gold = None
    decision = decide(comparison, PromotionParams(judge=None))
    assert decision.promote and decision.score == "proxy"
    assert any("compares proxy" in r for r in decision.reasons)


def test_too_few_paired_queries_are_no_evidence():
    decision = decide(_comparison(0.5, n=8), PromotionParams(min_queries=32))
    assert not decision.promote and any("only 8 held-out queries" in r for r in decision.reasons)


def test_sides_pair_by_query_and_repeated_queries_pair_in_order():
    challenger = Side("c", ["a", "b", "a", "z"], ["ca1", "cb", "ca2", "cz"])
    incumbent = Side("p", ["b", "a", "a", "y"], ["pb", "pa1", "pa2", "py"])
    seen = []

    def scorer(queries, responses):
        seen.append(list(zip(queries, responses)))
        return [float(len(r)) for r in responses]

    result = compare(challenger, incumbent, proxy=scorer, judge=None, judge_name=None, kl=1.0)
    assert seen[0] == [("a", "ca1"), ("b", "cb"), ("a", "ca2")]
    assert seen[1] == [("a", "pa1"), ("b", "pb"), ("a", "pa2")]
    # "a" answered twice on each side is one query with two responses (evaluate.responses_per_query)
    assert result.queries == 2 and result.proxy.n == 2
    assert any("1 of the challenger's 4 responses" in note for note in result.notes)


def test_paired_averages_a_querys_responses_before_the_error():
    # query a: differences 1 and 3 (mean 2); query b: 0 and 0; query c: -1 and 5 (mean 2)
    challenger = [2.0, 4.0, 1.0, 1.0, 0.0, 6.0]
    incumbent = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    result = paired(challenger, incumbent, ["a", "a", "b", "b", "c", "c"])
    assert result.n == 3 and result.mean == pytest.approx(4 / 3)
    assert result.stderr == pytest.approx(np.std([2.0, 0.0, 2.0], ddof=1) / np.sqrt(3))
    # every row its own query: the error of six independent differences, a different number
    alone = paired(challenger, incumbent)
    assert alone.n == 6 and alone.stderr == pytest.approx(np.std([1, 3, 0, 0, -1, 5], ddof=1) / np.sqrt(6))
    assert alone.stderr != pytest.approx(result.stderr)
    # one row per query: the same as without queries, to the bit
    assert paired(challenger, incumbent, list("abcdef")) == alone
    with pytest.raises(ValueError, match="at least 2 queries"):
        paired([1.0, 2.0], [0.0, 0.0], ["a", "a"])


@pytest.mark.parametrize(
    ("gold", "proxy", "hacking"),
    [
        (Paired(-0.05, 0.01, 64), Paired(0.50, 0.02, 64), True),  # its own RM +25 SE, the judge -5 SE
        (Paired(-0.005, 0.01, 64), Paired(0.50, 0.02, 64), False),  # the judge within tolerance: no claim
        (Paired(0.05, 0.01, 64), Paired(0.50, 0.02, 64), False),  # both up
        (Paired(-0.05, 0.01, 64), Paired(0.01, 0.02, 64), False),  # worse on both: bad, not hacking
    ],
)
def test_a_proxy_gain_the_judge_refutes_is_reported_as_reward_hacking(gold, proxy, hacking):
    """The decision shows the proxy gain beside the judged gain; a proxy gain beyond tolerance with a
    judged loss beyond tolerance is named reward hacking (the gate rejects it on the judge's score)."""
    comparison = Comparison("policy@v2.0.0", "policy@v1.0.0", 64, gold, proxy, 4.0, "vader")
    decision = decide(comparison, PromotionParams())
    assert decision.reward_hacking is hacking
    text = render(decision, "policy@v2.0.0", "registered")
    assert f"- Proxy-judge gap: the challenger's own reward model puts it {proxy.in_se:+.1f} SE" in text
    assert ("**Reward hacking**" in text) is hacking
    if hacking:
        assert not decision.promote and any("reward hacking" in r for r in decision.reasons)


def test_a_frozen_judge_scores_with_its_own_reward_model_and_says_what_it_measured(tiny_base_dir, tmp_path):
    """promotion.judge naming a reward model folder: its SHA256SUMS are checked, it scores (query,
    response) pairs, and the decision's notes carry what its card measured on its golden labels."""
    import torch
    from huggingface_hub import ModelCard, ModelCardData

    from rlhf_pipeline.errors import DamagedArtifactError
    from rlhf_pipeline.io import write_checksums
    from rlhf_pipeline.judges import frozen_judge_folder, judge_accuracy, judge_scorer
    from rlhf_pipeline.modelcard import held_out_result
    from rlhf_pipeline.models import load_tokenizer, save_tokenizer
    from rlhf_pipeline.reward.adoption import reward_model_on_base
    from rlhf_pipeline.reward.persistence import save_reward_model

    tokenizer = load_tokenizer(tiny_base_dir)
    model = reward_model_on_base(tiny_base_dir, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    folder = tmp_path / "data/models/judge"
    save_reward_model(model.eval(), folder)
    save_tokenizer(tokenizer, folder)
    measured = held_out_result("best-of-4 test accuracy", 0.71, "golden labels", "accuracy")
    data = ModelCardData(model_name="judge", eval_results=[measured])
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n# Judge\n").save(folder / "README.md")
    write_checksums(folder)

    rule = PromotionParams(judge="data/models/judge", golden_labels="data/labels/golden.jsonl")
    with frozen_judge_folder(tmp_path, rule) as checked:
        scores = judge_scorer(tmp_path, rule, checked)(["a query", "another"], [" a reply", " a second reply"])
        said = judge_accuracy(rule, checked)
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
    assert said.startswith("frozen judge data/models/judge (golden labels: data/labels/golden.jsonl): ")
    assert "best-of-4 test accuracy: 0.71" in said

    # both ways: the judge's own ranking of eight responses, its better half given to one side, then to the other
    queries = [f"query {i}" for i in range(4)] * 2
    pool = [f" reply number {i} is {'good' if i % 2 else 'bad'}" for i in range(8)]
    with frozen_judge_folder(tmp_path, rule) as checked:
        judge = judge_scorer(tmp_path, rule, checked)
        ranked = [r for _, r in sorted(zip(judge(queries, pool), pool))]
        worse, better = ranked[:4], ranked[4:]
        for mine, theirs, promote in ((better, worse, True), (worse, better, False)):
            comparison = compare(
                Side("challenger", queries[:4], mine), Side("prod", queries[:4], theirs),
                proxy=lambda q, r: [0.0] * len(r), judge=judge, judge_name=rule.judge, kl=1.0,
            )  # fmt: skip
            decision = decide(
                comparison, PromotionParams(**{**rule.model_dump(), "tolerance_se": 0.0, "min_queries": 2})
            )
            assert decision.promote is promote and decision.score == "gold", decision.reasons

    (folder / "README.md").write_text("edited")
    with pytest.raises(DamagedArtifactError, match="promotion.judge data/models/judge"):
        with frozen_judge_folder(tmp_path, rule):
            pass


# --------------------------------------------------------------------------------------------
# promotion.score: human: people's side-by-side verdicts
def test_the_wilson_interval_matches_its_textbook_values():
    low, high = wilson(0.5, 100, 0.95)  # z = 1.96: 0.5 ± 0.0962 / 1.0384
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    low, high = wilson(0.0, 10, 0.95)  # no win in 10: the interval still reaches up, never below 0
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.2775, abs=1e-4)
    assert wilson(0.7, 0, 0.95) == (0.0, 1.0)


def _human(wins: int, ties: int, losses: int, people: int = 2) -> Comparison:
    comparison = _comparison(0.0)
    comparison.gold = None
    n = wins + ties + losses
    shares = {f"person{i}": n // people + (i < n % people) for i in range(people)}
    comparison.human = Tally(wins, ties, losses, 0.5, 0.95, shares)
    return comparison


@pytest.mark.parametrize(
    ("wins", "ties", "losses", "promote"),
    [
        (40, 4, 20, True),  # 65.6 % of 64
        (26, 4, 34, True),  # 43.8 %: the interval (32 % to 56 %) still reaches 50 %
        (18, 4, 42, False),  # 31.3 %: the interval (21 % to 43 %) stays below 50 %
    ],
)
def test_the_human_rule_promotes_when_the_win_rate_s_interval_reaches_half(wins, ties, losses, promote):
    decision = decide(_human(wins, ties, losses), PromotionParams(score="human", judge=None))
    assert decision.score == "human" and decision.promote is promote, decision.reasons
    (reason,) = [r for r in decision.reasons if r.startswith("human:")]
    assert f"{wins} wins, {ties} ties at 0.5, {losses} losses; 2 people" in reason


def test_ties_count_as_the_params_say():
    half = Tally(10, 20, 10, 0.5, 0.95, {"a": 40})
    none = Tally(10, 20, 10, 0.0, 0.95, {"a": 40})
    assert half.win_rate == pytest.approx(0.5) and none.win_rate == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("wins", "people", "rule", "short"),
    [
        (
            30,
            2,
            {"min_judgements": 64},
            "30 verdicts from 2 people; the rule needs at least 64 from at least 2 (promotion.human)",
        ),
        (
            64,
            1,
            {"min_annotators": 2},
            "64 verdicts from 1 person; the rule needs at least 64 from at least 2 (promotion.human)",
        ),
    ],
)
def test_too_few_verdicts_or_people_decide_nothing(wins, people, rule, short):
    params = PromotionParams(score="human", human=rule)
    comparison = _human(wins, 0, 0, people)
    assert human_shortfall(comparison.human, params) == short
    assert not decide(comparison, params).promote
    assert human_shortfall(None, params) == "no side-by-side verdicts yet"


def test_people_refuting_the_proxy_is_reward_hacking_and_the_page_shows_counts_interval_and_shares():
    comparison = _human(12, 2, 50, people=3)
    comparison.proxy = Paired(1.5, 0.1, 64)  # its own reward model: +15 SE
    decision = decide(comparison, PromotionParams(score="human", judge=None))
    assert not decision.promote and decision.reward_hacking
    page = render(decision, "policy@v2.0.0", "prod stays policy@v1.0.0")
    assert "| challenger vs policy@v1.0.0 | 64 | 12 | 2 | 50 | 20.3% | 12.3% to 31.7% |" in page
    assert "person0 22 (34%), person1 21 (33%), person2 21 (33%)" in page
    assert "Proxy-people gap: the challenger's own reward model puts it +15.0 SE" in page
    assert "**Reward hacking**" in page
    assert "while people prefer it in 20% of 64 side-by-side verdicts (its interval reaches 32%, below 50%)" in page
