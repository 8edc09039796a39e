"""PPO trainer on the tiny model: exactness of the speed-ups, determinism, resume, failure modes."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import add_pipeline_definition, full_params
from safetensors.torch import load_file

import rlhf_pipeline.ppo.checkpoint as checkpoint_module
from rlhf_pipeline.errors import NonFiniteError
from rlhf_pipeline.io import write_checksums
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params.ppo import ADVANTAGE_ESTIMATORS, CRITIC_FREE
from rlhf_pipeline.params.schema import Params
from rlhf_pipeline.ppo import advantages
from rlhf_pipeline.ppo.advantages import CRITIC_FREE_ESTIMATORS
from rlhf_pipeline.ppo.checkpoint import Checkpointer, rng_state, set_rng_state, snapshot_name, snapshot_update
from rlhf_pipeline.ppo.parts import TrainerParts
from rlhf_pipeline.ppo.policy import PolicyWithValue, build_policy
from rlhf_pipeline.ppo.rollout import RolloutMaker
from rlhf_pipeline.ppo.trainer import PPOTrainer
from rlhf_pipeline.reward.adoption import reward_model_on_base
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.reward.persistence import save_reward_model
from rlhf_pipeline.sampling import hidden_from

REPO = Path(__file__).resolve().parents[1]
# No truncation token: the tiny random model rarely samples '.', and we want real RM scores.
TASK = {"response_length": 6, "truncate_token": None, "temperature": 0.7}
PPO = {
    "total_episodes": 64,
    "batch_size": 16,
    "nminibatches": 2,
    "microbatch_size": 4,
    "checkpoint_every": 2,
    "lr": 1.0e-3,
}


def make_params(**ppo) -> Params:
    return Params.model_validate({"task": TASK, "ppo": {**PPO, **ppo}})


@pytest.fixture(scope="module")
def reward_model(tiny_base_dir):
    tokenizer = load_tokenizer(tiny_base_dir)
    return reward_model_on_base(
        tiny_base_dir, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0)
    ).eval()


@pytest.fixture(scope="module")
def queries(tiny_base_dir):
    pad = load_tokenizer(tiny_base_dir).pad_token_id
    q = torch.randint(0, 250, (40, 5), generator=torch.Generator().manual_seed(0))
    q[:8, :2] = pad  # some left padding
    return q


def make_trainer(tiny_base_dir, reward_model, queries, params: Params, checkpoint_dir=None, log=None, accelerator=None):
    torch.manual_seed(params.seed)
    tokenizer = load_tokenizer(tiny_base_dir)
    if params.ppo.value_model == "shared" or params.ppo.critic_free:
        policy = build_policy(tiny_base_dir, params.ppo)
    else:
        policy = PolicyWithValue(
            load_causal_lm(tiny_base_dir),
            reward_model.backbone.__class__.from_pretrained(tiny_base_dir),
            torch.nn.Linear(64, 1),
        )
    checkpointer = Checkpointer(checkpoint_dir, "test") if checkpoint_dir else None
    parts = TrainerParts(
        policy=policy,
        ref_model=load_causal_lm(tiny_base_dir) if params.ppo.lora is None else None,  # LoRA: the adapter off
        reward_model=reward_model,
        queries=queries,
        tokenizer=tokenizer,
        task=params.task,
        cfg=params.ppo,
        seed=params.seed,
        device=torch.device("cpu"),
        checkpointer=checkpointer,
        log=log,
    )
    return PPOTrainer(parts, accelerator)


class ShareOf:
    """Process ``index`` of ``count`` as the trainer sees it, inside one process: it takes its share of
    every batch; a gather returns its own rows (no other process is there to send theirs)."""

    def __init__(self, index: int, count: int):
        from accelerate.utils import DistributedType

        self.process_index, self.num_processes, self.is_main_process = index, count, index == 0
        self.distributed_type, self.device = DistributedType.NO, torch.device("cpu")

    def prepare(self, *objects):
        return objects

    def gather(self, tensor):
        return tensor


def test_trunk_split_is_exact(tiny_base_dir):
    """Running the top blocks from the reference model's cached activation equals a full forward."""
    model = load_causal_lm(tiny_base_dir).eval()
    ids = torch.randint(0, 250, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :3] = False
    full, trunk = hidden_from(model, ids, mask, return_trunk_at=1)
    top = hidden_from(model, ids, mask, start_layer=1, trunk=trunk)
    torch.testing.assert_close(top, full, atol=1e-5, rtol=1e-5)


def test_sampling_logprobs_are_the_training_logprobs(tiny_base_dir, reward_model, queries):
    """Old logprobs come from the sampling pass; the first PPO forward must agree (ratio 1)."""
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params())
    ro = trainer.rollout(0)
    attn = ro.query_responses != trainer.pad_id
    with torch.no_grad():
        logprobs, _, values = trainer.policy(ro.query_responses, attn, trainer.query_length, 0.7, trainer.pad_id)
    torch.testing.assert_close(logprobs, ro.logprobs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(values, ro.values, atol=1e-5, rtol=1e-5)
    assert torch.all(ro.values == 0), "the shared value head is zero-initialised"
    # policy == reference at the start: KL exactly ~0
    assert (ro.logprobs - ro.ref_logprobs).abs().max() < 1e-4


def test_seeded_training_is_deterministic_and_learns_something(tiny_base_dir, reward_model, queries):
    params = make_params()
    runs = []
    for _ in range(2):
        trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
        before = trainer.policy.lm.model.layers[1].mlp.up_proj.weight.detach().clone()
        history = trainer.train(progress=False)
        runs.append((history, trainer.policy.lm.model.layers[1].mlp.up_proj.weight.detach().clone(), trainer))
    (h1, w1, t1), (h2, w2, _) = runs
    assert len(h1) == params.ppo.total_episodes // params.ppo.batch_size == 4
    assert torch.equal(w1, w2), "same seed must give bit-identical weights"
    assert not torch.equal(w1, before), "training changed the weights"
    assert [r["objective/score"] for r in h1] == [r["objective/score"] for r in h2]
    # adaptive KL controller: coef_{t+1} = coef_t * (1 + clip(KL/target - 1, +-0.2) * batch/horizon)
    kl0, coef0, coef1 = h1[0]["objective/kl"], h1[0]["objective/kl_coef"], h1[1]["objective/kl_coef"]
    expected = coef0 * (1 + max(-0.2, min(0.2, kl0 / 6.0 - 1)) * 16 / 10000)
    assert coef1 == pytest.approx(expected, rel=1e-6)
    for record in h1:
        assert 0.0 <= record["policy/clipfrac"] <= 1.0
        assert record["lr"] <= params.ppo.lr
        # the sampled tokens' log-probabilities against the first training forward's: rounding apart, the same
        assert 0.0 <= record["policy/logprob_gap_mean"] <= record["policy/logprob_gap_max"] < 1e-3
    # LR annealed linearly to 0 across updates: update u uses lr * (1 - u / U)
    assert [r["lr"] for r in h1] == pytest.approx([1e-3 * (1 - u / 4) for u in range(4)])


@pytest.mark.parametrize("freeze_layers", [0, 1])
def test_under_the_invariant_attention_the_rollout_trainer_gap_is_zero(
    tiny_base_dir, reward_model, queries, freeze_layers
):
    """compute.attention: invariant: every update's first training forward gives each sampled token the
    log-probability its sampling step gave it, to the bit, from the whole model or from the trunk the
    sampling kept (the PPO ratio starts at exactly 1). The log-probabilities share one formula
    (functional.log_softmax_logprobs) and the attention gives a row the same bytes decoded or in a full forward."""
    from rlhf_pipeline.attention import INVARIANT, SDPA, use_attention

    params = make_params(freeze_layers=freeze_layers, total_episodes=32)
    try:
        use_attention(INVARIANT)
        history = make_trainer(tiny_base_dir, reward_model, queries, params).train(progress=False)
    finally:
        use_attention(SDPA)
    assert [(r["policy/logprob_gap_max"], r["policy/logprob_gap_mean"]) for r in history] == [(0.0, 0.0)] * 2


@pytest.mark.parametrize("freeze_layers", [0, 1])
def test_recomputed_logits_train_the_weights_kept_logits_train(tiny_base_dir, reward_model, queries, freeze_layers):
    """ppo.recompute_logits: the backward makes the LM head's logits again instead of keeping them. The tiny
    batch's logits are one block either way, so two updates write the same weights, to the bit, and the same
    statistics: the recomputation repeats the forward op for op."""
    from rlhf_pipeline.ppo.policy import trainable_state

    runs = []
    for recompute in (False, True):
        params = make_params(freeze_layers=freeze_layers, total_episodes=32, recompute_logits=recompute)
        trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
        assert trainer.policy.recompute_logits is recompute
        history = trainer.train(progress=False)
        runs.append((history, trainable_state(trainer.policy)))
    (kept_history, kept), (recomputed_history, recomputed) = runs
    assert kept_history == recomputed_history
    assert kept.keys() == recomputed.keys() and all(torch.equal(kept[k], recomputed[k]) for k in kept)


def test_frozen_layers_train_only_the_top(tiny_base_dir, reward_model, queries):
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(freeze_layers=1, total_episodes=32))
    assert trainer.rollouts.use_trunk
    bottom = trainer.policy.lm.model.layers[0].mlp.up_proj.weight.detach().clone()
    top = trainer.policy.lm.model.layers[1].mlp.up_proj.weight.detach().clone()
    history = trainer.train(progress=False)
    assert torch.equal(bottom, trainer.policy.lm.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(top, trainer.policy.lm.model.layers[1].mlp.up_proj.weight)
    # the first minibatch of the first epoch sees ratio == 1 only if the trunk path is exact
    assert abs(history[0]["policy/ratio_mean"] - 1.0) < 0.05


def test_with_the_trunk_split_the_budget_s_exact_kl_reads_the_policy_s_sampling_states(
    tiny_base_dir, reward_model, queries, monkeypatch
):
    """ppo.kl.budget with frozen lower blocks: the sampling forwards keep the policy's final states beside the
    trunk, and the rollout's and the budget reading's exact KL take them instead of running the policy's top
    blocks once more over query and response; the KLs agree with that forward's within rounding. Without a
    budget nothing more is kept."""
    from rlhf_pipeline import sampling

    params = make_params(freeze_layers=1, total_episodes=32, kl={"budget": 5.0, "budget_check_responses": 16})
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
    assert trainer.rollouts.use_trunk and trainer.rollouts.capture_layers == (1, 2)
    trainer.optimize(trainer.rollout(0), trainer.advantages(trainer.rollout(0)), 0)  # a policy off the reference

    def read():
        calls = []
        hook = trainer.policy.lm.model.layers[1].register_forward_hook(lambda *_: calls.append(1))
        try:
            return trainer.rollout(1).stats.kl_exact, trainer.rollouts.extra_kl(1), len(calls)
        finally:
            hook.remove()

    rollout_kl, reading, calls = read()
    assert calls == 2 * (1 + TASK["response_length"])  # two sampling passes: a prefill and a step per token
    monkeypatch.setattr(sampling, "sampled_response_hidden", lambda *_: None)  # the forward instead
    forward_rollout_kl, forward_reading, forward_calls = read()
    assert forward_calls == calls + 2 and rollout_kl > 1e-4 and reading > 1e-4
    assert rollout_kl == pytest.approx(forward_rollout_kl, abs=1e-5)
    assert reading == pytest.approx(forward_reading, abs=1e-5)
    unbounded = make_trainer(tiny_base_dir, reward_model, queries, make_params(freeze_layers=1, total_episodes=32))
    assert unbounded.rollouts.capture_layers == (1,) and unbounded.rollouts.policy_hidden(None, None, None) is None


def test_separate_value_model_runs(tiny_base_dir, reward_model, queries):
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(value_model="separate", total_episodes=16))
    history = trainer.train(progress=False)
    assert len(history) == 1 and all(v == v for v in history[0].values() if isinstance(v, float))


@pytest.mark.parametrize(
    "ppo",
    [{}, {"lora": {"rank": 4, "alpha": 8.0}, "freeze_layers": 1, "advantage": "rloo", "samples_per_query": 2}],
    ids=["full", "lora-rloo"],
)
def test_resume_after_crash_is_bit_identical(tiny_base_dir, reward_model, queries, tmp_path, ppo):
    params = make_params(**ppo)
    reference = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "uninterrupted")
    reference.train(progress=False)

    class Crash(Exception):
        pass

    def crash_after_update_3(record):
        random.random()  # other code in the process draws from Python's generator (Prefect's threads do)
        if record["update"] == 3:
            raise Crash

    crashing = make_trainer(
        tiny_base_dir, reward_model, queries, params, tmp_path / "crashed", log=crash_after_update_3
    )
    with pytest.raises(Crash):
        crashing.train(progress=False)
    assert json.loads((tmp_path / "crashed/state/meta.json").read_text())["update"] == 2
    resumed = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "crashed")
    history = resumed.train(progress=False)
    assert resumed.start_update == 2 and len(history) == 4
    assert reference.policy.state_dict().keys() == resumed.policy.state_dict().keys()
    for (name, a), b in zip(reference.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
    # every file of the checkpoint folder, the training state (optimizer included) and meta.json too
    files = {
        run: {p.relative_to(tmp_path / run): p.read_bytes() for p in (tmp_path / run).rglob("*") if p.is_file()}
        for run in ("uninterrupted", "crashed")
    }
    assert files["crashed"].keys() == files["uninterrupted"].keys()
    assert [name for name in files["crashed"] if files["crashed"][name] != files["uninterrupted"][name]] == []


def test_the_kl_budget_rolls_back_the_first_policy_read_over_it(tiny_base_dir, reward_model, queries, tmp_path):
    """ppo.kl.budget: the first policy whose (here: rollout's) KL reads over the budget is rolled back to the
    one before it (the unbounded run's after the same updates), which ends the run; its snapshot goes, and
    a resumed run ends there too."""
    kl_params = {"budget_window": 2, "budget_check_responses": 0}
    unbounded = make_trainer(
        tiny_base_dir,
        reward_model,
        queries,
        make_params(total_episodes=96, checkpoint_every=1, lr=1.0e-4, kl={"budget": 1.0e6, **kl_params}),
        tmp_path / "unbounded",
    )
    history = unbounded.train(progress=False)
    kls = [record["objective/kl_exact"] for record in history]  # kls[u]: the policy after u updates
    assert len(history) == 6 and unbounded.budget.stopped is None and kls[0] == pytest.approx(0.0, abs=1e-5)
    assert all(kl >= -1e-6 for kl in kls) and kls[-1] > 0.01
    assert not any("objective/kl_checked" in record for record in history)  # never close to 1e6: never read
    # a budget the policies before `over` keep within and the policy after `over` updates passes: with a
    # window of 2 the forecast is at least the last reading, so that rollout is read (with 0 more
    # responses, the reading is the rollout's) and rolled back
    over = next(u for u in range(2, 6) if kls[u] > max(kls[:u]))
    budget = (max(kls[:over]) + kls[over]) / 2
    params = make_params(total_episodes=96, checkpoint_every=4, lr=1.0e-4, kl={"budget": budget, **kl_params})
    bounded = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "bounded")
    assert len(bounded.train(progress=False)) == over - 1
    assert bounded.budget.stopped == {
        "updates": over - 1,
        "kl": pytest.approx(kls[over - 1]),
        "rolled_back_kl": pytest.approx(kls[over]),
        "budget": budget,
    }
    kept = load_file(tmp_path / f"unbounded/snapshots/{snapshot_name(over - 1)}")
    for name, weight in load_file(tmp_path / f"bounded/snapshots/{snapshot_name(over - 1)}").items():
        assert torch.equal(weight, kept[name]), name
    trained = {name: p for name, p in bounded.policy.lm.named_parameters() if p.requires_grad}
    assert trained and all(torch.equal(p, kept[f"lm.{name}"]) for name, p in trained.items())
    # no snapshot of a later policy is left, and every one left is in SHA256SUMS
    snapshots = sorted(snapshot_update(p) for p in (tmp_path / "bounded/snapshots").glob("update_*.safetensors"))
    assert snapshots[-1] == over - 1 and checkpoint_module.snapshot_problem(tmp_path / "bounded/snapshots") is None
    sums = (tmp_path / "bounded/snapshots/SHA256SUMS").read_text()
    assert all(snapshot_name(u) in sums for u in snapshots) and sums.count("update_") == len(snapshots)
    assert json.loads((tmp_path / "bounded/state/meta.json").read_text())["update"] == over - 1
    # a resume from the last checkpoint ends there, with the kept policy, training nothing
    resumed = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "bounded")
    assert len(resumed.train(progress=False)) == over - 1 and resumed.budget.stopped == bounded.budget.stopped
    assert all(torch.equal(p, kept[f"lm.{n}"]) for n, p in resumed.policy.lm.named_parameters() if p.requires_grad)


def test_a_backtrack_keeps_part_of_the_step_read_within_the_budget(
    tiny_base_dir, reward_model, queries, tmp_path, monkeypatch
):
    """ppo.kl.budget_backtracks: the policy a fraction of the undone update's way from the one before it
    (the unbounded run's snapshots), read within the budget, is the result; a resumed run ends alike; a
    bisection that read further along than the fraction it keeps holds the kept fraction's weights."""
    kl_params = {"budget_window": 2, "budget_check_responses": 32}

    def run(budget, directory, backtracks, search="halve"):
        params = make_params(
            total_episodes=96,
            checkpoint_every=1,
            lr=1.0e-4,
            kl={"budget": budget, **kl_params, "budget_backtracks": backtracks, "budget_search": search},
        )
        trainer = make_trainer(tiny_base_dir, reward_model, queries, params, directory)
        return trainer, trainer.train(progress=False)

    _, history = run(1.0e6, tmp_path / "unbounded", 0)
    kls = [record["objective/kl_exact"] for record in history]
    over = next(u for u in range(2, 6) if kls[u] > max(kls[:u]))
    plain, _ = run((max(kls[:over]) + kls[over]) / 2, tmp_path / "plain", 0)
    rolled = plain.budget.stopped["updates"] + 1  # the update whose policy first read over the budget
    # a higher budget the undone policy still passes: no check before it decides otherwise (a check needs a
    # forecast past the budget), and half its step lies well within
    kept_kl, over_kl = plain.budget.stopped["kl"], plain.budget.stopped["rolled_back_kl"]
    budget = max(plain.budget.stopped["budget"], kept_kl + 0.8 * (over_kl - kept_kl))
    bounded, kept_history = run(budget, tmp_path / "bounded", 2)
    assert bounded.budget.stopped["updates"] == rolled and bounded.budget.stopped["rolled_back_kl"] == over_kl
    fraction = bounded.budget.stopped["step_fraction"]
    assert fraction in (0.5, 0.25) and bounded.budget.stopped["kl"] <= budget and len(kept_history) == rolled
    before = load_file(tmp_path / f"unbounded/snapshots/{snapshot_name(rolled - 1)}")
    after = load_file(tmp_path / f"unbounded/snapshots/{snapshot_name(rolled)}")
    trained = {f"lm.{n}": p for n, p in bounded.policy.lm.named_parameters() if p.requires_grad}
    for name, p in trained.items():
        torch.testing.assert_close(p, before[name] + fraction * (after[name] - before[name]), rtol=0, atol=1e-6)
    kept = load_file(tmp_path / f"bounded/snapshots/{snapshot_name(rolled)}")
    assert all(torch.equal(kept[name], p) for name, p in trained.items())
    resumed, resumed_history = run(budget, tmp_path / "bounded", 2)
    assert resumed.budget.stopped == bounded.budget.stopped and len(resumed_history) == rolled
    assert all(torch.equal(p, trained[f"lm.{n}"]) for n, p in resumed.policy.lm.named_parameters() if p.requires_grad)

    # bisect: half the step read within, then three quarters over (the tries' readings set here, the
    # budget's own check left as it is): half is kept, and the policy goes back to it from three quarters
    real_extra_kl = RolloutMaker.extra_kl

    tries = []

    def extra_kl(self, update, draw=0):
        if draw == 0:
            return real_extra_kl(self, update, draw)
        tries.append(draw)
        return budget - 0.1 if len(tries) == 1 else budget + 1.0

    monkeypatch.setattr(RolloutMaker, "extra_kl", extra_kl)
    bisected, _ = run(budget, tmp_path / "bisected", 2, search="bisect")
    assert bisected.budget.stopped["updates"] == rolled
    assert bisected.budget.stopped["step_fraction"] == 0.5 and bisected.budget.stopped["kl"] == budget - 0.1
    assert tries == [1, 1]  # both fractions read on the same draw
    for name, p in bisected.policy.lm.named_parameters():
        if p.requires_grad:
            half = before[f"lm.{name}"] + 0.5 * (after[f"lm.{name}"] - before[f"lm.{name}"])
            torch.testing.assert_close(p, half, rtol=0, atol=1e-6)


def test_the_budget_reading_is_the_mean_over_more_responses_and_leaves_training_as_it_was(
    tiny_base_dir, reward_model, queries
):
    """The precise reading samples its own responses with a generator of its own: the same value twice,
    training's random streams untouched; 0 more responses: the rollout's own mean; the unchanged policy
    (the reference itself): 0."""
    params = make_params(kl={"budget": 5.0, "budget_check_responses": 24})
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
    ro = trainer.rollout(0)
    assert trainer.rollouts.checked_kl(ro, 0) == pytest.approx(0.0, abs=1e-5)
    trainer.optimize(ro, trainer.advantages(ro), 0)
    ro = trainer.rollout(1)
    state = torch.get_rng_state()
    first, second = trainer.rollouts.checked_kl(ro, 1), trainer.rollouts.checked_kl(ro, 1)
    assert first == second and first > 1e-4 and first != pytest.approx(ro.stats.kl_exact)
    assert torch.equal(torch.get_rng_state(), state)
    none_more = make_trainer(
        tiny_base_dir, reward_model, queries, make_params(kl={"budget": 5.0, "budget_check_responses": 0})
    )
    ro = none_more.rollout(0)
    assert none_more.rollouts.checked_kl(ro, 0) == ro.stats.kl_exact


@pytest.mark.parametrize("freeze_layers", [0, 1])
def test_the_budget_reading_samples_its_chunks_in_one_pass_as_it_would_one_by_one(
    tiny_base_dir, reward_model, queries, freeze_layers, monkeypatch
):
    """The reading's 40 responses come in chunks of ppo.batch_size (16, 16, 8); on a CPU one decoding pass
    samples them all, with each chunk's uniforms drawn first: the reading is the one the chunks give one by
    one (with the trunk split too, whose captured activations are sliced per chunk)."""
    params = make_params(kl={"budget": 5.0, "budget_check_responses": 40}, freeze_layers=freeze_layers)
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
    trainer.optimize(trainer.rollout(0), trainer.advantages(trainer.rollout(0)), 0)
    passes = []
    real_sample = RolloutMaker.sample

    def counted(self, chunk, *args, **kwargs):
        passes.append(len(chunk))
        return real_sample(self, chunk, *args, **kwargs)

    monkeypatch.setattr(RolloutMaker, "sample", counted)
    one_pass = trainer.rollouts.extra_kl(1)
    assert passes == [40]

    def one_by_one(self, chunks, generator):
        for chunk in chunks:
            yield chunk, self.sample(chunk, generator, num_samples=1)[0]

    passes.clear()
    monkeypatch.setattr(RolloutMaker, "sample_chunks", one_by_one)
    chunked = trainer.rollouts.extra_kl(1)
    assert passes == [16, 16, 8]
    assert one_pass > 1e-4 and one_pass == pytest.approx(chunked, rel=1e-5)


@pytest.mark.parametrize("freeze_layers", [0, 1])
def test_the_budget_reading_runs_the_reference_head_only_in_the_exact_kl_and_reads_the_same_bits(
    tiny_base_dir, reward_model, queries, freeze_layers, monkeypatch
):
    """The reading needs only the exact KL: the reference's logprobs are not made (its LM head projects each
    response token once, in the KL, not twice), and the KL is the one read with them made, bit for bit."""
    params = make_params(kl={"budget": 5.0, "budget_check_responses": 24}, freeze_layers=freeze_layers)
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
    trainer.optimize(trainer.rollout(0), trainer.advantages(trainer.rollout(0)), 0)
    head = trainer.parts.ref_model.get_output_embeddings()
    rows = []
    hook = head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:-1].numel()))
    try:
        without_logprobs = trainer.rollouts.extra_kl(1)
        counted_without = sum(rows)
        rows.clear()
        real = RolloutMaker.reference_logprobs
        monkeypatch.setattr(
            RolloutMaker, "reference_logprobs", lambda self, *a, logprobs=True, **k: real(self, *a, logprobs=True, **k)
        )
        with_logprobs = trainer.rollouts.extra_kl(1)
        counted_with = sum(rows)
    finally:
        hook.remove()
    positions = 24 * params.task.response_length
    assert counted_without == positions and counted_with == 2 * positions
    assert without_logprobs > 1e-4 and without_logprobs == with_logprobs
    with pytest.raises(ValueError, match="neither"):
        real(trainer, torch.zeros(2, 3, dtype=torch.long), None, logprobs=False)


def test_critic_free_estimators_build_no_value_head_and_sample_query_groups(tiny_base_dir, reward_model, queries):
    """GRPO with 4 samples per query: no value head or value loss; the rollout holds 4 consecutive
    responses to each of batch_size / 4 queries, and each group's advantages sum to 0."""
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(advantage="grpo", samples_per_query=4))
    assert trainer.policy.value_head is None and not any("value" in n for n, _ in trainer.policy.named_parameters())
    ro = trainer.rollout(0)
    assert ro.values is None and ro.responses.shape[0] == 16
    groups = ro.queries.view(4, 4, -1)
    assert all(torch.equal(group[0], row) for group in groups for row in group)
    assert len({tuple(group[0].tolist()) for group in groups}) == 4  # four different queries
    adv = trainer.advantages(ro)
    assert adv.returns is None
    torch.testing.assert_close(adv.advantages.view(4, 4, -1).sum(1), torch.zeros(4, 6), atol=1e-5, rtol=0)
    history = trainer.train(progress=False)
    assert "loss/policy" in history[-1] and not {"loss/value", "val/mean", "returns/mean"} & set(history[-1])


def test_lora_trains_an_adapter_whose_base_is_the_reference(tiny_base_dir, reward_model, queries, tmp_path):
    """ppo.lora: no reference copy is loaded (the adapter off is the reference); only the adapter's
    weights (above freeze_layers) and the value head train; the snapshot and the saved policy hold
    the merged weights, which a stock AutoModelForCausalLM loads with the adapter's outputs."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.ppo.policy import save_policy
    from rlhf_pipeline.sampling import response_outputs

    params = make_params(lora={"rank": 4, "alpha": 8.0}, freeze_layers=1)
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "ck")
    assert trainer.parts.ref_model is None
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("value_head.") for n in trainable)
    assert all(".layers.1." in n for n in trainable if ".lora_" in n)  # block 0 (frozen) carries no adapter
    trainer.train(progress=False)
    base = load_causal_lm(tiny_base_dir).eval()
    ro = trainer.rollout(0)
    attn = ro.query_responses != trainer.pad_id
    expected = response_outputs(base, ro.query_responses, attn, trainer.query_length, 0.7, trainer.pad_id).logprobs
    torch.testing.assert_close(ro.ref_logprobs, expected, atol=1e-5, rtol=1e-5)
    assert (ro.logprobs - ro.ref_logprobs).abs().max() > 1e-3  # the adapter moved the policy
    with torch.no_grad():
        adapted = trainer.policy.lm(ro.query_responses, attention_mask=attn.long()).logits
    snapshot = load_file(tmp_path / "ck/snapshots/update_00004.safetensors")
    save_policy(trainer.policy, load_tokenizer(tiny_base_dir), tmp_path / "policy", 0.7, 6)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    assert not any("lora" in n for n, _ in stock.named_parameters())
    assert (tmp_path / "policy/value_head.safetensors").is_file()  # GAE: the value head is kept beside the merge
    merged = dict(stock.named_parameters())
    assert snapshot and all(torch.equal(merged[name.removeprefix("lm.")], t) for name, t in snapshot.items())
    with torch.no_grad():
        torch.testing.assert_close(stock(ro.query_responses, attention_mask=attn.long()).logits, adapted)


def test_lora_on_several_processes_is_refused_before_anything_loads(monkeypatch):
    from rlhf_pipeline.distributed import refuse_unsupported
    from rlhf_pipeline.errors import LaunchConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchConfigError, match="ppo.lora trains on one process only") as info:
        refuse_unsupported(torch.device("cpu"), False, "train_policy", lora=True)
    assert info.value.exit_code == 2
    refuse_unsupported(torch.device("cpu"), False, "train_policy", lora=False)  # full fine-tune: allowed


def test_checkpoint_with_other_fingerprint_starts_fresh(tmp_path):
    (tmp_path / "state").mkdir(parents=True)
    (tmp_path / "state/meta.json").write_text(json.dumps({"fingerprint": "old", "update": 3}))
    assert Checkpointer(tmp_path, "new").prepare() is False
    assert not (tmp_path / "state").exists()


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(
    tiny_base_dir, reward_model, queries, tmp_path, monkeypatch
):
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(), tmp_path / "ck")
    real_optimize = trainer.optimize

    def poisoned(ro, adv, update):
        if update == 2:
            adv = dataclasses.replace(adv, advantages=adv.advantages * float("nan"))
        return real_optimize(ro, adv, update)

    monkeypatch.setattr(trainer, "optimize", poisoned)
    with pytest.raises(NonFiniteError, match="non-finite"):
        trainer.train(progress=False)
    assert json.loads((tmp_path / "ck/state/meta.json").read_text())["update"] == 2


def test_an_error_mid_run_ends_the_progress_bar_s_line(tiny_base_dir, reward_model, queries, capsys, monkeypatch):
    """The bar is closed when an update fails, so the stage's error message (printed next, on stderr
    too) starts a line of its own instead of running on after the bar's last refresh."""
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params())
    real_rollout = trainer.rollout

    def failing(update):
        if update == 1:
            raise NonFiniteError("the weights after update 1 are not finite")
        return real_rollout(update)

    monkeypatch.setattr(trainer, "rollout", failing)
    with pytest.raises(NonFiniteError) as info:  # held, as the stage runner holds it while it reports it
        trainer.train(progress=True)
    err = capsys.readouterr().err
    assert "train_policy" in err and err.endswith("\n"), repr(err[-200:])
    assert info.value.exit_code == 4


def test_stop_at_eos_masks_tokens_after_eos(tiny_base_dir, reward_model, queries):
    params = Params.model_validate(
        {
            "task": {**TASK, "stop_at_eos": True, "temperature": 3.0, "response_length": 12},
            "ppo": {**PPO, "total_episodes": 16},
        }
    )
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
    eos = trainer.parts.tokenizer.eos_token_id
    # force eos to be likely by biasing its logit through the output embedding row
    with torch.no_grad():
        trainer.policy.lm.get_output_embeddings().weight[eos] *= 0
    ro = trainer.rollout(0)
    for row, mask in zip(ro.responses, ro.mask):
        hits = (row == eos).nonzero()
        if len(hits):
            first = hits[0].item()
            assert mask[: first + 1].all() and not mask[first + 1 :].any()
            assert (row[first + 1 :] == trainer.pad_id).all()


# --------------------------------------------------------------------------------------------
# the stage, killed with SIGKILL and rerun
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy_project(tiny_base_dir, reward_model, queries, tmp_path_factory):
    """A project directory with models/base, models/reward and data/queries for train_policy."""
    from datasets import Dataset, DatasetDict

    root = tmp_path_factory.mktemp("policy_project")
    shutil.copytree(tiny_base_dir, root / "models/base")
    # the CPU default's reward layout: mean pooling, backbone in backbone/, a top-level config.json
    # that only names load_reward_model (stock AutoModel loaders refuse it with that name)
    mean_pooling = RewardModel(reward_model.backbone, reward_model.pad_token_id, "mean")
    mean_pooling.head.load_state_dict(reward_model.head.state_dict())
    save_reward_model(mean_pooling, root / "models/reward")
    assert (root / "models/reward/backbone/config.json").exists()
    assert "load_reward_model" in (root / "models/reward/config.json").read_text()
    load_tokenizer(tiny_base_dir).save_pretrained(root / "models/reward")
    write_checksums(root / "models/reward")  # what normalize_reward writes: stages check it before loading
    rows = {"query_ids": queries.tolist(), "query": ["q"] * len(queries)}
    DatasetDict({"train": Dataset.from_dict(rows), "test": Dataset.from_dict(rows)}).save_to_disk(
        str(root / "data/queries")
    )
    params = {
        "task": TASK,
        "compute": {"device": "cpu"},
        "ppo": {**PPO, "total_episodes": 160, "checkpoint_every": 2},
        "data": {"preferences": {"source": "user.jsonl"}},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(full_params(params)))
    add_pipeline_definition(root)
    return root


def run_stage(root: Path, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    for item in ("models", "data", "params.yaml", "dvc.yaml"):
        if not (out / item).exists():
            (shutil.copytree if (root / item).is_dir() else shutil.copy)(root / item, out / item)
    env = {**os.environ, "RLHF_PROJECT_ROOT": str(out), "GIT_DIR": "/nonexistent"}
    return subprocess.Popen(
        [sys.executable, str(REPO / "stages/train_policy.py")],
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.e2e
def test_stage_killed_with_sigkill_resumes_bit_identical(policy_project, tmp_path):
    whole = run_stage(policy_project, tmp_path / "whole")
    output, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, output

    victim = run_stage(policy_project, tmp_path / "killed")
    meta = tmp_path / "killed/checkpoints/policy/state/meta.json"
    deadline = time.time() + 240
    while time.time() < deadline and not meta.exists():
        time.sleep(0.05)
    assert meta.exists(), "no checkpoint appeared"
    # kill between checkpoints: once an update past the checkpoint (every 2) is in the DVCLive log
    score = tmp_path / "killed/dvclive/train_policy/plots/metrics/objective/score.tsv"
    while time.time() < deadline and not (score.exists() and len(score.read_text().splitlines()) - 1 in (3, 5, 7)):
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed/models/policy").exists(), "killed before the final model was written"
    killed_at = json.loads(meta.read_text())["update"]
    assert killed_at < 10
    assert len(score.read_text().splitlines()) - 1 > killed_at, "killed after an update the checkpoint does not hold"

    rerun = run_stage(policy_project, tmp_path / "killed")
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    assert "resuming from update" in output
    a = (tmp_path / "whole/models/policy/model.safetensors").read_bytes()
    b = (tmp_path / "killed/models/policy/model.safetensors").read_bytes()
    assert a == b, "resumed weights differ from an uninterrupted run"
    # the DVCLive series (what `dvc plots` draws) match too: one row per update, same steps and values
    for series in ("objective/score", "objective/kl", "loss/policy"):
        whole_rows, killed_rows = (live_series(tmp_path / run, series) for run in ("whole", "killed"))
        assert len(whole_rows) == 10 and killed_rows == whole_rows, series


def live_series(run: Path, name: str) -> list[tuple[str, str]]:
    """(step, value) rows of a DVCLive metric of train_policy (the timestamp column differs by design)."""
    lines = (run / "dvclive/train_policy/plots/metrics" / f"{name}.tsv").read_text().splitlines()
    header = lines[0].split("\t")
    step, value = header.index("step"), len(header) - 1
    return [(row.split("\t")[step], row.split("\t")[value]) for row in lines[1:]]


def test_a_non_finite_gradient_with_a_finite_loss_writes_nothing(tiny_base_dir, reward_model, queries, tmp_path):
    """A NaN in one gradient at the last optimizer step of update 4 (the loss stays finite, as an
    fp16/bf16 overflow in the backward pass gives): training stops with exit code 4 before the step,
    the checkpoint of update 2 stays the last one and is named, and its weights are finite."""
    params = make_params()
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "ck")
    steps_per_update = params.ppo.ppo_epochs * params.ppo.nminibatches
    micro_per_step = params.ppo.batch_size // params.ppo.nminibatches // params.ppo.microbatch_size
    calls = {"n": 0}
    poison_at = (
        3 * steps_per_update * micro_per_step + steps_per_update * micro_per_step
    )  # the last micro-batch of update 4

    def poison(grad):
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == poison_at else grad

    weight = next(p for p in trainer.policy.parameters() if p.requires_grad)
    weight.register_hook(poison)
    with pytest.raises(NonFiniteError) as info:
        trainer.train(progress=False)
    assert info.value.exit_code == 4
    assert "Non-finite gradient at update 3" in str(info.value)
    assert f"last good checkpoint (update 2, {tmp_path / 'ck' / 'state'})" in str(info.value)
    assert json.loads((tmp_path / "ck/state/meta.json").read_text())["update"] == 2
    saved = load_file(str(tmp_path / "ck/state/trainable.safetensors"))
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())  # the poisoned step was never taken


def test_a_failure_before_any_checkpoint_says_there_is_none(
    tiny_base_dir, reward_model, queries, tmp_path, monkeypatch
):
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(), tmp_path / "ck")
    real_optimize = trainer.optimize
    nan = lambda adv: dataclasses.replace(adv, advantages=adv.advantages * float("nan"))  # noqa: E731
    monkeypatch.setattr(trainer, "optimize", lambda ro, adv, update: real_optimize(ro, nan(adv), update))
    with pytest.raises(NonFiniteError, match="no checkpoint exists yet: the next run starts from update 0"):
        trainer.train(progress=False)
    assert not (tmp_path / "ck/state").exists()


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"weights after update 2 are not finite \(weight"):
        Checkpointer(tmp_path, "f").save(2, dict(model.named_parameters()), {}, {}, {}, [], [])
    assert not (tmp_path / "state").exists()


def test_training_state_has_no_pickle(tmp_path):
    """The checkpoint's optimizer/RNG state loads with weights_only=True, and a pickle that would
    run code is refused instead of run."""
    torch.manual_seed(3)
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = torch.rand(1).item()
    torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.rand(1).item() == expected

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"optimizer": Evil()}, tmp_path / "training_state.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(tmp_path / "training_state.pt", weights_only=True)
    assert not marker.exists()
    assert "weights_only=False" not in Path(checkpoint_module.__file__).read_text()


def checkpointed_run(tiny_base_dir, reward_model, queries, directory):
    """Two updates with a checkpoint after each; returns the checkpoint directory."""
    trainer = make_trainer(
        tiny_base_dir, reward_model, queries, make_params(total_episodes=32, checkpoint_every=1), directory
    )
    trainer.train(progress=False)
    return directory


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "garbage meta"])
def test_a_damaged_checkpoint_is_detected_and_training_starts_clean(
    tiny_base_dir, reward_model, queries, tmp_path, capsys, damage
):
    directory = checkpointed_run(tiny_base_dir, reward_model, queries, tmp_path / "ck")
    weights = directory / "state/trainable.safetensors"
    if damage == "flipped byte":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01  # inside a tensor: safetensors itself would load it silently
        weights.write_bytes(bytes(data))
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        (directory / "state/meta.json").write_text("{not json")
    damaged = {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    assert Checkpointer(directory, "test").prepare() is False
    err = capsys.readouterr().err
    aside = tmp_path / "ck.damaged-1"
    assert (
        f"the checkpoint in {directory / 'state'} is unusable (" in err and "training starts again from update 0" in err
    )
    assert f"it was moved to {aside}" in err
    assert not (directory / "state").exists() and directory.is_dir()
    # set aside whole, snapshots included, for a post-mortem; a second damaged one goes beside it
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == damaged
    checkpointed_run(tiny_base_dir, reward_model, queries, directory)
    (directory / "state/meta.json").write_text("{not json")
    assert Checkpointer(directory, "test").prepare() is False
    assert (tmp_path / "ck.damaged-2" / "state" / "meta.json").read_text() == "{not json"


def test_an_intact_checkpoint_passes_its_checksums(tiny_base_dir, reward_model, queries, tmp_path):
    directory = checkpointed_run(tiny_base_dir, reward_model, queries, tmp_path / "ck")
    meta = json.loads((directory / "state/meta.json").read_text())
    assert set(meta["sha256"]) == set(Checkpointer.STATE_FILES)
    assert Checkpointer(directory, "test").prepare() is True


def test_a_kill_between_the_two_renames_keeps_the_previous_checkpoint(tiny_base_dir, reward_model, queries, tmp_path):
    """atomic_dir parks the old state as .state.old-PID, then renames the new one in; killed in
    between, the next start puts the parked state back and removes the half-written debris."""
    directory = checkpointed_run(tiny_base_dir, reward_model, queries, tmp_path / "ck")
    os.replace(directory / "state", directory / ".state.old-4242")
    (directory / ".state.tmp-abc").mkdir()
    (directory / ".state.tmp-abc/trainable.safetensors").write_bytes(b"half")
    snapshots = sorted(p.name for p in (directory / "snapshots").iterdir())
    (directory / "snapshots/.update_00003.safetensors.tmp-xyz").write_bytes(b"half")  # a snapshot write killed
    assert Checkpointer(directory, "test").prepare() is True
    assert json.loads((directory / "state/meta.json").read_text())["update"] == 2
    assert sorted(p.name for p in directory.iterdir()) == ["snapshots", "state"]
    assert sorted(p.name for p in (directory / "snapshots").iterdir()) == snapshots


@pytest.mark.e2e
def test_the_stages_train_and_evaluate_a_critic_free_lora_policy(policy_project, tmp_path):
    """train_policy with ppo.advantage grpo, 2 samples per query, a LoRA adapter and the k3 KL, then
    evaluate: the saved policy is a stock causal LM (merged, no value head), its card says how it was
    trained, and the evaluation reports the KL PPO penalised (k3) and k1 beside it."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    shutil.copytree(policy_project, out)
    params = yaml.safe_load((out / "params.yaml").read_text())
    params["ppo"] |= {"advantage": "grpo", "samples_per_query": 2, "lora": {"rank": 4}, "freeze_layers": 1}
    params["ppo"]["kl"]["estimator"] = "k3"
    params["evaluate"] |= {"num_queries": 8, "batch_size": 8}
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    for stage in ("train_policy", "evaluate"):
        env = {**os.environ, "RLHF_PROJECT_ROOT": str(out)}
        done = subprocess.run(
            [sys.executable, str(REPO / f"stages/{stage}.py")], cwd=out, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
    policy = out / "models/policy"
    assert not (policy / "value_head.safetensors").exists()
    assert not any("lora" in name for name, _ in AutoModelForCausalLM.from_pretrained(policy).named_parameters())
    card = (policy / "README.md").read_text()
    assert "critic-free GRPO advantage (2 samples per query)" in card and "rank-4 LoRA adapter, merged" in card
    metrics = json.loads((out / "metrics/evaluate.json").read_text())
    assert metrics["kl/mean"] >= 0.0 and "kl/k1_mean" in metrics  # k3 is never negative


# ---- what the ppo section asks of the model, refused before it loads -------------------------
FIT_CASES = {
    "a target naming no module": (
        {"lora": {"target_modules": ["nope_proj"]}, "freeze_layers": 1},
        "'nope_proj' names no module of the trained blocks 1-1",
    ),
    "a norm layer": ({"lora": {"target_modules": ["input_layernorm"]}}, "'input_layernorm' is a LlamaRMSNorm"),
    "the LM head": ({"lora": {"target_modules": ["lm_head"]}}, "'lm_head' names no module of the trained blocks 0-1"),
    "a rank above the width": ({"lora": {"rank": 500}}, "ppo.lora.rank: 500, more than the width"),
    "every block frozen with LoRA": (
        {"lora": {"rank": 4}, "freeze_layers": 2},
        "ppo.freeze_layers: 2, but the base model",
    ),
    "every block frozen": ({"freeze_layers": 2}, "has 2 blocks; at most 1"),
}


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_a_ppo_section_the_model_cannot_train_is_named_from_its_config(case, tiny_base_dir):
    from rlhf_pipeline.fit import ppo_fit_problems as fit_problems
    from rlhf_pipeline.models import model_skeleton

    overrides, message = FIT_CASES[case]
    problems = fit_problems(make_params(**overrides).ppo, model_skeleton(tiny_base_dir), "models/base")
    assert len(problems) == 1 and message in problems[0], problems


def test_a_ppo_section_the_model_can_train_has_no_fit_problem(tiny_base_dir):
    from rlhf_pipeline.fit import ppo_fit_problems as fit_problems
    from rlhf_pipeline.models import model_skeleton

    skeleton = model_skeleton(tiny_base_dir)
    assert next(skeleton.parameters()).device.type == "meta"  # nothing was read or allocated
    for overrides in ({}, {"freeze_layers": 1}, {"lora": {"rank": 4, "target_modules": ["q_proj", "mlp.down_proj"]}}):
        assert fit_problems(make_params(**overrides).ppo, skeleton, "models/base") == []


def test_lora_alpha_and_process_split_are_refused_by_the_schema_and_the_launch(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"ppo\.lora\.alpha"):
        make_params(lora={"alpha": 1e300})
    rloo = make_params(advantage="rloo", samples_per_query=2, batch_size=6, nminibatches=1, microbatch_size=2).ppo
    assert rloo.process_split_problem(1) is None
    assert "its 3 queries (of ppo.samples_per_query 2 responses each) evenly" in rloo.process_split_problem(2)
    pieces = make_params(rollout_microbatch_size=8, microbatch_size=2).ppo  # a batch of 16
    assert pieces.process_split_problem(2) is None
    assert "ppo.rollout_microbatch_size (8) must divide each process's share of ppo.batch_size (16 over 4" in (
        pieces.process_split_problem(4)
    )
    with pytest.raises(ValidationError, match=r"multiple of ppo\.samples_per_query \(2"):
        make_params(advantage="rloo", samples_per_query=2, rollout_microbatch_size=3)


def test_the_budget_reading_gives_each_row_its_one_process_draw_on_any_number_of_processes(
    tiny_base_dir, reward_model, queries, monkeypatch
):
    """The reading's 40 responses come in chunks of ppo.batch_size (16, 16, 8), each shared by the processes
    as a rollout's batch is: each of two processes samples its share of every chunk, and every response's
    uniforms are the ones one process gives it, with or without ppo.rollout_microbatch_size."""
    real_sample, drawn = RolloutMaker.sample, {}

    def recorded(self, chunk, generator, *args, uniforms=None, **kwargs):
        assert uniforms is not None  # drawn first: 3 chunks on a CPU, or pieces
        drawn.update({tuple(row.tolist()): draw for row, draw in zip(chunk, uniforms)})
        return real_sample(self, chunk, generator, *args, uniforms=uniforms, **kwargs)

    monkeypatch.setattr(RolloutMaker, "sample", recorded)
    readings = {}
    for pieces in (None, 4):
        params = make_params(kl={"budget": 5.0, "budget_check_responses": 40}, rollout_microbatch_size=pieces)
        for count in (1, 2):
            drawn.clear()
            for index in range(count):
                trainer = make_trainer(tiny_base_dir, reward_model, queries, params, accelerator=ShareOf(index, count))
                trainer.rollouts.extra_kl(1)
            readings[pieces, count] = dict(drawn)
    one = readings[None, 1]
    assert len(one) == 40  # one response to each of the 40 (distinct) train queries
    for key, draws in readings.items():
        assert draws.keys() == one.keys(), key
        assert all(torch.equal(draws[row], one[row]) for row in one), key


@pytest.mark.parametrize("samples_per_query", [1, 2])
def test_a_rollout_in_pieces_runs_its_forwards_on_the_pieces_and_gives_each_row_its_one_pass_draw(
    tiny_base_dir, reward_model, queries, samples_per_query, monkeypatch
):
    """ppo.rollout_microbatch_size 4 of a batch of 16: the sampling pass and the reward model's forward run
    on 4 rows at a time, each row's uniform at each step is the one a single pass over the batch gives it
    (so the pieces sample what that pass samples wherever the products over 4 and 16 rows round alike), and
    the rows come back in the one pass's order, whole groups of a query's samples together."""
    from rlhf_pipeline import decoding

    real_draw = decoding.sample_from_logits

    def rollout(pieces):
        draws, scored = [], []

        def recorded(logits, generator=None, block_size=256, process_share=(0, 1), uniforms=None):
            if uniforms is None:  # what sample_from_logits would draw itself
                uniforms = decoding.step_uniforms(generator, len(logits), process_share, logits.device)
            draws.append(uniforms)
            return real_draw(logits, generator, block_size, process_share, uniforms)

        def scores(self, rows, truncated, valid):
            scored.append(len(rows))
            return real_scores(self, rows, truncated, valid)

        monkeypatch.setattr(decoding, "sample_from_logits", recorded)
        monkeypatch.setattr(RolloutMaker, "scores", scores)
        overrides = {"rollout_microbatch_size": pieces, "samples_per_query": samples_per_query}
        trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(**overrides))
        ro = trainer.rollout(0)
        steps = TASK["response_length"]
        # the draws of each sampling call (one per decoding step), piece after piece: (16, steps)
        per_call = [torch.cat(draws[i : i + steps], 1) for i in range(0, len(draws), steps)]
        return ro, torch.cat(per_call), scored

    real_scores = RolloutMaker.scores
    whole, whole_draws, whole_scored = rollout(None)
    pieces, piece_draws, piece_scored = rollout(4)
    assert whole_scored == [16] and piece_scored == [4, 4, 4, 4]
    assert piece_draws.shape == whole_draws.shape == (16, TASK["response_length"])
    assert torch.equal(piece_draws, whole_draws)
    assert torch.equal(pieces.queries, whole.queries) and pieces.scores.shape == (16,)
    if samples_per_query == 2:  # each query's two responses are consecutive rows
        assert torch.equal(pieces.queries[0::2], pieces.queries[1::2])
    for name in ("responses", "logprobs", "ref_logprobs", "values", "scores", "trunk"):
        assert (getattr(pieces, name) is None) == (getattr(whole, name) is None), name
    # where the pieces sampled the one pass's tokens, their logprobs are its logprobs to rounding
    same = (pieces.responses == whole.responses).all(1)
    assert same.any()
    torch.testing.assert_close(pieces.logprobs[same], whole.logprobs[same], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pieces.ref_logprobs[same], whole.ref_logprobs[same], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["a target naming no module", "every block frozen with LoRA"])
@pytest.mark.e2e
def test_train_policy_refuses_before_loading_and_check_params_agrees(case, project, capsys, monkeypatch):
    """The stage: exit 2, one paragraph, before any model loads (no reward model is even needed);
    `rlhf check-params`: the same problem once models/base was built from base_model.source."""
    from conftest import run_stage_script

    import rlhf_pipeline.models as models_module
    from rlhf_pipeline.cli import main
    from rlhf_pipeline.modelcard import save_card
    from rlhf_pipeline.params.schema import load_params

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the ppo section was checked")

    monkeypatch.setattr(models_module, "load_causal_lm", no_load)
    overrides, message = FIT_CASES[case]
    project.write_params(**{f"ppo.{key}": value for key, value in overrides.items()})
    assert run_stage_script("train_policy") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (project / "models" / "policy").exists()

    base = project / "models" / "base"
    copy = project / "models" / "base-copy"
    shutil.copytree(base.resolve(), copy)
    base.unlink()
    copy.rename(base)
    with pytest.raises(SystemExit) as exit_:  # a model not built from base_model.source is not held against it
        main(["check-params"])
    assert exit_.value.code == 0 and "values that depend on the model were not checked" in capsys.readouterr().out
    source = load_params("params.yaml").base_model.source
    save_card(base, {"source": source, "library_name": "transformers"}, "# Base model\n")
    with pytest.raises(SystemExit) as exit_:
        main(["check-params"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "split",
    [{"freeze_layers": 0}, {"freeze_layers": 1}, {"freeze_layers": 1, "lora": {"rank": 4}}, {"lora": {"rank": 4}}],
    ids=["whole", "trunk-1", "trunk-1-lora", "lora"],
)
def test_the_first_update_starts_at_the_reference(split, tiny_base_dir, reward_model, queries):
    """Before any step the policy is the reference: the KL of update 1's rollout is 0 for every
    valid trunk split, up to fp32 rounding. The old logprobs come from the sampling pass (one token at
    a time over the cache) and the reference's from one pass over query + response, so the products
    round differently: by up to 1e-5 a token where MKL takes its AVX2 kernels (3.6e-6 summed over a
    response, CI's AMD machine and MKL_ENABLE_INSTRUCTIONS=AVX2 alike), 1e-6 under AVX-512. The bound is
    torch.testing's fp32 atol (1e-5) per response token; one step later the KL is 0.05 to 2.4 here."""
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(total_episodes=16, **split))
    (first,) = trainer.train(progress=False)
    assert abs(first["objective/kl"]) <= 1e-5 * TASK["response_length"], first["objective/kl"]


def test_the_estimator_names_are_one_table():
    """ppo.advantage's names (params) and the functions the trainer calls (ppo/advantages.py) agree:
    gae plus one function for each critic-free name, and nothing else."""
    assert set(CRITIC_FREE_ESTIMATORS) == set(CRITIC_FREE)
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", *CRITIC_FREE_ESTIMATORS}
    with pytest.raises(ValueError, match=r"expected one of \['gae', 'rloo', 'grpo'\]"):
        advantages.estimate("ppo", torch.zeros(2, 3), None, torch.ones(2, 3), 1.0, 0.95, 2)


def test_snapshot_names_are_written_and_read_by_one_rule(tmp_path):
    """The checkpointer names each snapshot with snapshot_name; the evaluation reads the update back
    with snapshot_update, and the snapshot glob finds it."""
    assert snapshot_name(7) == "update_00007.safetensors" and snapshot_update(snapshot_name(123456)) == 123456
    assert snapshot_update(tmp_path / snapshot_name(12)) == 12
    assert Path(snapshot_name(3)).match(checkpoint_module.SNAPSHOT_GLOB)
