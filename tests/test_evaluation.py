"""Evaluation metrics on hand-made numbers: per-sequence KL, win rate, the summary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_pipeline.evaluation import (
    SampleSet,
    curve_point,
    curve_queries,
    length_stats,
    overoptimization_plot,
    paired_improvement,
    sequence_kl,
    summarize,
    win_rate,
)
from rlhf_pipeline.ppo import kl
from rlhf_pipeline.sampling import response_logits


def test_sequence_kl_sums_logprob_differences_over_real_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
    ref = torch.tensor([[-1.5, -1.0, -2.5], [-0.1, -0.7, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # row 0: 0.5 - 1.0 + 2.0 = 1.5; row 1: 0 + 0.5 (third token masked out) = 0.5
    torch.testing.assert_close(sequence_kl(logprobs, ref, mask), torch.tensor([1.5, 0.5]))
    torch.testing.assert_close(sequence_kl(logprobs, ref), torch.tensor([1.5, 9.2]))


def test_sequence_kl_follows_the_estimator_ppo_penalised():
    # k3 = (r - 1) - log r with r = exp(ref - logp): logp - ref = [.5, -1] -> r = [e^-.5, e^1]
    #   (0.606531 - 1) + 0.5 = 0.106531;  (2.718282 - 1) - 1 = 0.718282;  sum 0.824813
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(sequence_kl(logprobs, ref, estimator="k3"), torch.tensor([0.824813]))
    torch.testing.assert_close(sequence_kl(logprobs, ref), torch.tensor([-0.5]))  # k1 can be negative


def test_summarize_reports_k1_beside_another_estimator():
    pad = 9
    base = sample_set([0.0, 1.0], None, [0.0, 0.0], [True, True], [[1, pad], [1, pad]])
    policy = sample_set([2.0, 1.0], None, [1.0, 3.0], [True, True], [[1, 2], [1, 2]], kl_k1=[0.5, 2.5])
    metrics = summarize(base, policy)
    assert metrics["kl/mean"] == pytest.approx(2.0) and metrics["kl/k1_mean"] == pytest.approx(1.5)
    assert "kl/k1_mean" not in summarize(base, sample_set([2.0, 1.0], None, [1.0, 3.0], [True, True], [[1, 2]] * 2))


def test_win_rate_counts_ties_as_half():
    assert win_rate([1.0, 2.0, 3.0, 0.0], [0.0, 2.0, 4.0, -1.0]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert win_rate(torch.tensor([0.3]), torch.tensor([0.2])) == 1.0
    with pytest.raises(ValueError):
        win_rate([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        win_rate([], [])


def test_paired_improvement_by_hand():
    """policy [0.4, 0.2, 0.9] vs base [0.1, 0.3, 0.5] on the same three queries:
    base std (population) sqrt(0.08 / 3) = 0.163299; differences [0.3, -0.1, 0.4], mean 0.2,
    sample sd sqrt(0.14 / 2) = 0.264575; improvement 0.2 / 0.163299 = 1.224745 base std,
    standard error 0.264575 / sqrt(3) / 0.163299 = 0.935414."""
    gain, stderr = paired_improvement([0.4, 0.2, 0.9], [0.1, 0.3, 0.5])
    assert gain == pytest.approx(1.224745, abs=1e-6)
    assert stderr == pytest.approx(0.935414, abs=1e-6)
    # pairing: a constant shift has no error at all, whatever the spread between queries
    assert paired_improvement([1.5, 2.5, 9.5], [1.0, 2.0, 9.0])[1] == pytest.approx(0.0)
    with pytest.raises(ValueError):
        paired_improvement([1.0], [0.0])


def test_paired_improvement_averages_each_querys_responses_first():
    """Two queries, two responses each (rows 0-1: query 0, rows 2-3: query 1). Base [0, 1, 2, 3]:
    population std sqrt(1.25); differences [1, 3, 0, 2]: per query 2 and 1, mean 1.5, sample sd
    sqrt(0.5); improvement 1.5 / sqrt(1.25) = 1.341641, standard error sqrt(0.5) / sqrt(2) / sqrt(1.25)
    = 0.447214. As four independent rows the error would be sd([1, 3, 0, 2]) / 2 / sqrt(1.25) = 0.577350."""
    policy, base = [1.0, 4.0, 2.0, 5.0], [0.0, 1.0, 2.0, 3.0]
    gain, stderr = paired_improvement(policy, base, responses_per_query=2)
    assert gain == pytest.approx(1.341641, abs=1e-6) and stderr == pytest.approx(0.447214, abs=1e-6)
    assert paired_improvement(policy, base)[1] == pytest.approx(0.577350, abs=1e-6)
    assert paired_improvement(policy, base)[0] == gain  # the mean is every response's either way
    with pytest.raises(ValueError, match="at least 2 queries"):
        paired_improvement([1.0, 2.0], [0.0, 0.0], responses_per_query=2)
    with pytest.raises(ValueError, match="not whole groups"):
        paired_improvement([1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 1.0, 2.0, 3.0, 4.0], responses_per_query=2)


def sample_set(proxy, gold, kl, valid, responses, kl_k1=None, kl_exact=None, responses_per_query=1):
    kl = torch.tensor(kl)
    return SampleSet(
        responses=torch.tensor(responses),
        valid=torch.tensor(valid),
        proxy=torch.tensor(proxy),
        gold=None if gold is None else np.array(gold),
        kl=kl,
        kl_k1=kl if kl_k1 is None else torch.tensor(kl_k1),
        kl_exact=kl if kl_exact is None else torch.tensor(kl_exact),
        texts=["x"] * len(proxy),
        responses_per_query=responses_per_query,
    )


def test_summarize_with_two_responses_per_query_takes_errors_over_queries():
    """Three queries, two responses each. Means are over the six responses; standard errors over the
    three queries' means; gold/queries counts queries."""
    k = 2
    base = sample_set(
        [0.0] * 6, [0.0, 1.0, 2.0, 3.0, 0.0, 0.0], [0.0] * 6, [True] * 6, [[1]] * 6, responses_per_query=k
    )
    policy = sample_set(
        [1.0] * 6,
        [1.0, 4.0, 2.0, 5.0, 1.0, 1.0],  # differences [1, 3, 0, 2, 1, 1]: per query 2, 1, 1
        [1.0, 3.0, 2.0, 2.0, 5.0, 5.0],  # per query 2, 2, 5: mean 3, sd sqrt(3)
        [True] * 6,
        [[1]] * 6,
        responses_per_query=k,
    )
    metrics = summarize(base, policy)
    assert metrics["gold/queries"] == 3 and metrics["responses_per_query"] == 2
    assert metrics["kl/mean"] == pytest.approx(3.0) and metrics["kl/stderr"] == pytest.approx(1.0)  # sqrt(3)/sqrt(3)
    scale = np.std([0.0, 1.0, 2.0, 3.0, 0.0, 0.0])  # the single responses' spread, not the query means'
    assert metrics["gold/improvement_in_base_std"] == pytest.approx((4 / 3) / scale)
    assert metrics["gold/improvement_stderr_in_base_std"] == pytest.approx(np.std([2, 1, 1], ddof=1) / 3**0.5 / scale)
    # a curve checkpoint on the first two queries pairs with the base's first four rows
    point = curve_point(5, policy.first(2), base)
    assert point["queries"] == 2 and point["kl"] == pytest.approx(2.0) and point["kl_stderr"] == pytest.approx(0.0)
    assert policy.first(2).responses_per_query == 2 and len(policy.first(2).proxy) == 4


def test_response_rows_repeat_the_query_for_each_of_its_responses():
    from rlhf_pipeline.evaluation_report import sample_rows

    base = sample_set([0.0, 0.1, 0.2, 0.3], None, [0.0] * 4, [True] * 4, [[1]] * 4, responses_per_query=2)
    policy = sample_set([1.0, 1.1, 1.2, 1.3], None, [0.5] * 4, [True] * 4, [[1]] * 4, responses_per_query=2)
    rows = sample_rows(["q0", "q1"], base, policy)
    assert [r["query"] for r in rows] == ["q0", "q0", "q1", "q1"]
    assert [r["policy_proxy"] for r in rows] == [1.0, 1.1, 1.2, 1.3]


def test_summarize_by_hand():
    pad = 9
    base = sample_set([0.0, 1.0], [0.1, 0.3], [0.0, 0.0], [True, False], [[1, 2, pad], [1, pad, pad]])
    policy = sample_set(
        [2.0, 1.0], [0.4, 0.2], [1.0, 3.0], [True, True], [[1, 2, 3], [1, 2, pad]], kl_exact=[1.75, 2.25]
    )
    metrics = summarize(base, policy)
    assert metrics["proxy/base_mean"] == pytest.approx(0.5)
    assert metrics["proxy/policy_mean"] == pytest.approx(1.5)
    assert metrics["kl/mean"] == pytest.approx(2.0)
    assert metrics["kl/stderr"] == pytest.approx(1.0)  # sd of [1, 3] is sqrt(2), / sqrt(2)
    # the exact KL, its own mean and error: sd of [1.75, 2.25] is sqrt(0.125), / sqrt(2) = 0.25
    assert metrics["kl/exact_mean"] == pytest.approx(2.0) and metrics["kl/exact_stderr"] == pytest.approx(0.25)
    assert metrics["win_rate/proxy"] == pytest.approx(0.75)  # 2 > 0, 1 == 1
    assert metrics["win_rate/gold"] == pytest.approx(0.5)  # 0.4 > 0.1, 0.2 < 0.3
    assert metrics["gold/base_mean"] == pytest.approx(0.2)
    assert metrics["gold/base_std"] == pytest.approx(0.1)
    assert metrics["gold/policy_mean"] == pytest.approx(0.3)
    assert metrics["gold/improvement_in_base_std"] == pytest.approx(1.0)
    # differences [0.3, -0.1]: sample sd 0.282843, / sqrt(2) / 0.1 = 2.0
    assert metrics["gold/improvement_stderr_in_base_std"] == pytest.approx(2.0)
    assert metrics["gold/queries"] == 2
    assert metrics["valid/base"] == pytest.approx(0.5) and metrics["valid/policy"] == pytest.approx(1.0)
    assert length_stats(base, pad) == {"mean": 1.5, "min": 1.0, "max": 2.0}
    assert length_stats(policy, pad) == {"mean": 2.5, "min": 2.0, "max": 3.0}


def test_curve_point_puts_proxy_and_gold_on_the_base_std_scale():
    base = sample_set([0.0, 1.0], [0.1, 0.3], [0.0, 0.0], [True, True], [[1], [1]])
    policy = sample_set([2.0, 1.0], [0.4, 0.2], [1.0, 3.0], [True, True], [[1], [1]], kl_exact=[2.0, 3.0])
    point = curve_point(7, policy, base)
    assert point["update"] == 7 and point["kl"] == pytest.approx(2.0) and point["sqrt_kl"] == pytest.approx(2.0**0.5)
    assert point["kl_stderr"] == pytest.approx(1.0)  # sd of [1, 3] is sqrt(2), / sqrt(2)
    assert point["kl_exact"] == pytest.approx(2.5) and point["kl_exact_stderr"] == pytest.approx(0.5)
    assert point["proxy_std_units"] == pytest.approx(2.0)  # +1.0 over a base std of 0.5
    assert point["gold_std_units"] == pytest.approx(1.0) and point["gold_stderr"] == pytest.approx(2.0)
    origin = curve_point(0, base, base)
    assert origin["proxy_std_units"] == 0.0 and origin["gold_stderr"] == 0.0


def test_a_checkpoint_on_the_first_queries_is_paired_with_the_base_there():
    """evaluate.curve_queries: the base's samples on the queries the checkpoint was drawn on, and the
    point says how many; the base's scale is the one of those queries."""
    base = sample_set([0.0, 1.0, 5.0], [0.1, 0.3, 0.9], [0.0] * 3, [True] * 3, [[1], [1], [1]])
    checkpoint = sample_set([2.0, 1.0], [0.4, 0.2], [1.0, 3.0], [True, True], [[1], [1]], kl_exact=[2.0, 3.0])
    point = curve_point(3, checkpoint, base)
    assert point["queries"] == 2 and curve_point(0, base, base)["queries"] == 3
    assert point["proxy_std_units"] == pytest.approx(2.0)  # as against the first two rows alone (above)
    assert point["gold_std_units"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "num_queries, wanted, batch_size, expected",
    [(292, None, 96, 292), (292, 96, 96, 96), (292, 100, 96, 192), (50, 96, 96, 50), (292, 1, 32, 32)],
)
def test_curve_queries_are_whole_batches_of_the_first_queries(num_queries, wanted, batch_size, expected):
    # whole batches: the sampler draws a batch's uniforms together, so each row gets the base's draw
    assert curve_queries(num_queries, wanted, batch_size) == expected


def test_the_best_checkpoint_is_the_best_improvement_on_its_own_queries():
    """A checkpoint sampled on fewer queries has a raw mean over other queries than the rest: the best is
    chosen by improvement over the base on the same queries; raw means where a point has none."""
    from rlhf_pipeline.evaluation_report import best_point

    points = [
        {"update": 0, "proxy": 0.0, "gold": 0.1, "gold_std_units": 0.0},
        {"update": 6, "proxy": 1.0, "gold": 0.5, "gold_std_units": 0.8, "queries": 96},  # easy queries
        {"update": 9, "proxy": 1.5, "gold": 0.4, "gold_std_units": 0.9, "queries": 292},
    ]
    assert best_point(points)["update"] == 9
    assert best_point([{**p, "gold_std_units": None} for p in points])["update"] == 6
    no_gold = [{**p, "gold": None, "proxy_std_units": p["proxy"]} for p in points]
    assert best_point(no_gold)["update"] == 9


def test_a_base_without_spread_makes_base_std_units_undefined(tmp_path):
    """Every base response scored alike (a degenerate reward model): the improvement is reported as
    null with the reason, not as a difference divided by ~0 (once 2e7 base σ)."""
    base = sample_set([0.25, 0.25 + 1e-9, 0.25], [0.1, 0.3, 0.2], [0.0] * 3, [True] * 3, [[1]] * 3)
    policy = sample_set([0.5, 0.2, 0.9], [0.4, 0.2, 0.5], [1.0] * 3, [True] * 3, [[1]] * 3)
    assert paired_improvement(policy.proxy.numpy(), base.proxy.numpy()) == (None, None)
    metrics = summarize(base, policy)
    assert metrics["proxy/improvement_in_base_std"] is None
    assert metrics["proxy/improvement_stderr_in_base_std"] is None
    assert "every base response scored alike" in metrics["proxy/improvement_undefined"]
    # gold has a spread: mean difference 1/6 over a base std of sqrt(0.02 / 3)
    assert metrics["gold/improvement_in_base_std"] == pytest.approx(2.041241, abs=1e-5)
    assert "gold/improvement_undefined" not in metrics
    point = curve_point(3, policy, base)
    assert point["proxy_std_units"] is None and point["proxy_stderr"] is None
    assert point["gold_std_units"] == pytest.approx(2.041241, abs=1e-5)
    overoptimization_plot([curve_point(0, base, base), point], tmp_path / "curve.png")  # gold only: drawn
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_summarize_without_a_gold_labeler_has_no_gold_metrics():
    base = sample_set([0.0, 0.5], None, [0.0, 0.0], [True, True], [[1], [1]])
    policy = sample_set([1.0, 0.7], None, [0.5, 0.1], [True, True], [[1], [1]])
    assert not any(key.startswith("gold/") or key == "win_rate/gold" for key in summarize(base, policy))


@pytest.mark.parametrize(
    "best_update, expected",
    [
        (
            4,
            "**update 4** (proxy 0.500, gold 0.300, KL 1.000); its weights are "
            "`checkpoints/policy/snapshots/update_00004.safetensors`",
        ),
        (0, "**the base model (update 0)** (proxy -0.500, gold 0.100, KL 0.000): no PPO checkpoint improved on it"),
    ],
)
def test_report_names_the_best_checkpoint(best_update, expected):
    from rlhf_pipeline.evaluation_report import render_report

    points = [{"update": 0, "kl": 0.0, "proxy": -0.5, "gold": 0.1}, {"update": 4, "kl": 1.0, "proxy": 0.5, "gold": 0.3}]
    best = next(p for p in points if p["update"] == best_update)
    report = render_report({"queries": 2, "kl/mean": 1.0}, points, best, [])
    assert f"Best checkpoint by gold score: {expected}" in report
    assert "| 4 | 1.000 | n/a | 0.500 | 0.300 |" in report  # a curve without the exact KL still renders
    points[1] |= {"kl_exact": 0.9, "kl_exact_stderr": 0.05}
    assert "| 4 | 1.000 | 0.900 +- 0.050 | 0.500 | 0.300 |" in render_report({"queries": 2}, points, best, [])


def tiny_evaluation(base_dir, tokenizer, scaled_layers, factor, response_length, queries, seed, batch_size):
    """(base, policy, setup) on the tiny model: the policy is the base with the MLP output of
    ``scaled_layers`` scaled by ``factor``; a reward model on the base; the setup samples ``queries``."""
    import copy

    from rlhf_pipeline.evaluation import Evaluation
    from rlhf_pipeline.models import load_causal_lm
    from rlhf_pipeline.params.task import TaskParams
    from rlhf_pipeline.reward.adoption import reward_model_on_base
    from rlhf_pipeline.sampling import ResponseSampler

    base = load_causal_lm(base_dir).eval()
    policy = copy.deepcopy(base)
    with torch.no_grad():
        for layer in scaled_layers:
            policy.model.layers[layer].mlp.down_proj.weight.mul_(factor)
    reward = reward_model_on_base(base_dir, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))
    sampler = ResponseSampler.from_tokenizer(
        TaskParams(response_length=response_length, truncate_token=None), tokenizer
    )
    setup = Evaluation(
        base=base,
        reward_model=reward.eval(),
        queries=queries,
        sampler=sampler,
        tokenizer=tokenizer,
        seed=seed,
        batch_size=batch_size,
    )
    return base, policy, setup


def test_kl_from_a_shared_trunk_equals_a_full_reference_pass(tiny_base_dir, tiny_tokenizer):
    """A policy whose lowest block is the base's: sample_and_score hands the base the trunk captured
    while sampling; the KL equals the one from a full forward of the base, and the base's own is 0."""
    from rlhf_pipeline.evaluation import Evaluation, sample_and_score
    from rlhf_pipeline.sampling import response_outputs, shared_lower_blocks

    pad = tiny_tokenizer.pad_token_id
    queries = torch.randint(0, 250, (6, 5), generator=torch.Generator().manual_seed(0))
    queries[:2, :2] = pad
    base, policy, setup = tiny_evaluation(tiny_base_dir, tiny_tokenizer, [1], 1.5, 6, queries, seed=3, batch_size=6)
    sampler = setup.sampler
    assert shared_lower_blocks(policy, base) == 1 and shared_lower_blocks(base, base) == 2
    result = sample_and_score(policy, setup)
    with torch.no_grad():
        again = sampler.sample(policy, queries, torch.Generator().manual_seed(3))[0]  # same stream, one batch
        full = torch.cat([queries, again.responses], 1)
        ref = response_outputs(base, full, full != pad, 5, sampler.task.temperature, pad).logprobs
    assert torch.equal(result.responses, again.responses)
    torch.testing.assert_close(result.kl, sequence_kl(again.logprobs, ref, again.mask), atol=1e-4, rtol=1e-4)
    assert result.kl.abs().max() > 1e-3  # the perturbation is visible
    # the exact KL from the trunk equals kl.exact_kl on both models' full forwards
    with torch.no_grad():
        args = (full, full != pad, 5, sampler.task.temperature, pad)
        mine, theirs = response_outputs(policy, *args).hidden, response_outputs(base, *args).hidden
        expected = kl.exact_kl(
            response_logits(policy, mine, sampler.task.temperature, pad),
            response_logits(base, theirs, sampler.task.temperature, pad),
            again.mask,
        )
    torch.testing.assert_close(result.kl_exact, expected, atol=1e-4, rtol=1e-4)
    assert (result.kl_exact > 0).all()  # exact: never negative, unlike k1
    itself = sample_and_score(base, Evaluation(**{**setup.__dict__, "batch_size": 4}))
    assert torch.equal(itself.kl, torch.zeros(6)) and torch.equal(itself.kl_exact, torch.zeros(6))


def test_with_a_shared_trunk_the_policy_s_kl_states_are_the_sampling_forwards(
    tiny_base_dir, tiny_tokenizer, monkeypatch
):
    """A policy that shares its lowest block with the base: its half of the exact KL is read off the final
    states its sampling forwards made, so its unshared block runs only while sampling (a prefill and one
    step a token), not once more over query and response; those states are a forward's within rounding, and
    the KL and the base's logprobs agree with the forward's (the logprobs the same bytes: the base still
    runs its own forward)."""
    from rlhf_pipeline import sampling
    from rlhf_pipeline.evaluation import sample_and_score
    from rlhf_pipeline.sampling import final_state_layer, response_hidden, sampled_response_hidden

    pad, length = tiny_tokenizer.pad_token_id, 6
    queries = torch.randint(0, 250, (6, 5), generator=torch.Generator().manual_seed(0))
    queries[:2, :2] = pad
    base, policy, setup = tiny_evaluation(tiny_base_dir, tiny_tokenizer, [1], 1.5, length, queries, 3, 6)

    def run():
        calls = []
        hook = policy.model.layers[1].register_forward_hook(lambda *_: calls.append(1))
        try:
            return sample_and_score(policy, setup), len(calls)
        finally:
            hook.remove()

    kept, kept_calls = run()
    assert kept_calls == 1 + length  # one batch: the prefill and a step per sampled token, the last one's too
    monkeypatch.setattr(sampling, "sampled_response_hidden", lambda *_: None)  # the forward instead
    forward, forward_calls = run()
    assert forward_calls == kept_calls + 1
    assert torch.equal(kept.responses, forward.responses) and torch.equal(kept.kl, forward.kl)
    torch.testing.assert_close(kept.kl_exact, forward.kl_exact, atol=1e-5, rtol=1e-5)
    assert kept.kl_exact.abs().max() > 1e-3
    with torch.no_grad():
        samples = setup.sampler.sample(
            policy, queries, torch.Generator().manual_seed(3), capture_layers=(1, final_state_layer(policy))
        )[0]
        full = torch.cat([queries, samples.responses], 1)
        again = response_hidden(policy, full, full != pad, 5, 1, samples.hidden[1])
    states = sampled_response_hidden(samples, policy, 5)
    assert states.shape == again.shape == (6, length, policy.config.hidden_size)
    torch.testing.assert_close(states, again, atol=1e-5, rtol=1e-5)
    assert sampled_response_hidden(samples.rows(slice(0, 2)), policy, 5).shape[0] == 2
    assert sampled_response_hidden(setup.sampler.sample(policy, queries, torch.Generator())[0], policy, 5) is None


def test_exact_kl_and_reference_logprobs_equal_full_forwards_and_are_zero_at_pad(tiny_base_dir, tiny_tokenizer):
    """The one function the evaluation (and the large-vocabulary probe) turns a batch of samples into its
    KLs with: the exact KL of both models' full forwards over the real tokens, and the reference's
    logprobs of the sampled tokens, 0 where a response was padded after its stop."""
    from rlhf_pipeline.decoding import SampleOutput
    from rlhf_pipeline.evaluation import exact_kl_and_reference_logprobs
    from rlhf_pipeline.sampling import response_outputs

    pad = tiny_tokenizer.pad_token_id
    queries = torch.randint(0, 250, (4, 5), generator=torch.Generator().manual_seed(6))
    base, policy, setup = tiny_evaluation(tiny_base_dir, tiny_tokenizer, [0, 1], 1.5, 6, queries, seed=2, batch_size=4)
    temperature = setup.sampler.task.temperature
    with torch.no_grad():
        out = setup.sampler.sample(policy, queries, torch.Generator().manual_seed(2))[0]
        responses, mask = out.responses.clone(), out.mask.clone()
        responses[1, 3:], mask[1, 3:] = pad, False  # row 1 stopped after 3 tokens
        samples = SampleOutput(responses, out.logprobs, None, mask)
        kl_exact, reference_logprobs = exact_kl_and_reference_logprobs(policy, base, queries, samples, temperature, pad)
        full = torch.cat([queries, responses], 1)
        args = (full, full != pad, 5, temperature, pad)
        theirs = response_outputs(base, *args)
        expected_kl = kl.exact_kl(
            response_logits(policy, response_outputs(policy, *args).hidden, temperature, pad),
            response_logits(base, theirs.hidden, temperature, pad),
            mask,
        )
    torch.testing.assert_close(kl_exact, expected_kl, atol=1e-4, rtol=1e-4)
    assert (kl_exact > 0).all()
    torch.testing.assert_close(reference_logprobs, theirs.logprobs, atol=1e-4, rtol=1e-4)
    assert torch.equal(reference_logprobs[1, 3:], torch.zeros(3)) and (reference_logprobs[0] < 0).all()


def test_the_base_s_head_projects_each_response_token_once_for_both_kls(tiny_base_dir, tiny_tokenizer):
    """The k1 KL (the base's logprobs of the sampled tokens) and the exact KL (the base's whole
    distribution) read one projection of the base's LM head: each response token's hidden state goes
    through it once, not twice; the KLs are checked against full forwards in the test above."""
    from rlhf_pipeline.evaluation import sample_and_score

    queries = torch.randint(0, 250, (6, 5), generator=torch.Generator().manual_seed(0))
    base, policy, setup = tiny_evaluation(tiny_base_dir, tiny_tokenizer, [1], 1.5, 6, queries, seed=3, batch_size=4)
    positions = []
    hook = base.get_output_embeddings().register_forward_hook(
        lambda module, args, out: positions.append(args[0].shape[:-1].numel())
    )
    try:
        result = sample_and_score(policy, setup)
    finally:
        hook.remove()
    assert sum(positions) == 6 * 6  # 6 responses of 6 tokens, in batches of 4 and 2
    assert result.kl.abs().max() > 1e-3 and (result.kl_exact > 0).all()


def test_several_responses_per_query_are_sampled_on_one_prefill_and_scored_on_their_query(
    tiny_base_dir, tiny_tokenizer
):
    """evaluate.responses_per_query = 2: rows 2i and 2i + 1 answer query i, drawn as the sampler draws
    two samples per query on the same stream; the KLs are the base's full forward on each row's own query,
    and the proxy the reward model's score of each row with its own query."""
    from rlhf_pipeline.evaluation import Evaluation, sample_and_score
    from rlhf_pipeline.reward.normalization import task_scores
    from rlhf_pipeline.sampling import response_outputs

    pad = tiny_tokenizer.pad_token_id
    queries = torch.randint(0, 250, (5, 5), generator=torch.Generator().manual_seed(2))
    queries[:2, :2] = pad
    base, policy, setup = tiny_evaluation(tiny_base_dir, tiny_tokenizer, [1], 1.5, 6, queries, seed=4, batch_size=6)
    setup = Evaluation(**{**setup.__dict__, "responses_per_query": 2})
    assert setup.queries_per_batch == 3  # 6 responses at once: 3 queries, then 2
    sampler = setup.sampler
    result = sample_and_score(policy, setup)
    assert len(result.responses) == 10 and result.num_queries == 5
    generator, expected = torch.Generator().manual_seed(4), []
    with torch.no_grad():
        for rows in (slice(0, 3), slice(3, 5)):
            expected.append(sampler.sample(policy, queries[rows], generator, num_samples=2)[0])
        responses = torch.cat([out.responses for out in expected])
        full = torch.cat([queries.repeat_interleave(2, 0), responses], 1)
        ref = response_outputs(base, full, full != pad, 5, sampler.task.temperature, pad).logprobs
        logprobs, mask = torch.cat([out.logprobs for out in expected]), torch.cat([out.mask for out in expected])
        truncated, valid = sampler.truncate(responses)
        proxy = task_scores(setup.reward_model, queries.repeat_interleave(2, 0), truncated, valid, -1.0, 6)
    assert torch.equal(result.responses, truncated)
    assert not torch.equal(result.responses[0::2], result.responses[1::2])  # two draws, not one twice
    torch.testing.assert_close(result.kl, sequence_kl(logprobs, ref, mask), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(result.proxy, proxy, atol=1e-5, rtol=1e-5)
    assert (result.kl_exact > 0).all()


def test_the_exact_kl_measures_k1s_mean_with_less_spread(tiny_base_dir, tiny_tokenizer):
    """Over many sampled responses the exact KL and k1 agree on the mean (both measure KL(pi || base)),
    and the exact one's spread is smaller: it does not depend on which token was drawn."""
    from rlhf_pipeline.evaluation import sample_and_score

    queries = torch.randint(0, 250, (16, 5), generator=torch.Generator().manual_seed(1)).repeat(40, 1)
    _, policy, setup = tiny_evaluation(tiny_base_dir, tiny_tokenizer, [0, 1], 3.0, 8, queries, seed=5, batch_size=80)
    result = sample_and_score(policy, setup)
    k1, exact = result.kl.double(), result.kl_exact.double()
    assert exact.mean() > 0.05  # a KL worth measuring
    both_se = (k1.var() / len(k1) + exact.var() / len(exact)).sqrt()
    assert (k1.mean() - exact.mean()).abs() < 3 * both_se
    assert exact.std() < 0.8 * k1.std()
