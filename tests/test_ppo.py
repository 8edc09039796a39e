"""PPO trainer on the tiny model: exactness of the speed-ups, determinism, resume, failure modes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import add_pipeline_definition

from rlhf_pipeline.errors import NonFiniteError
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params import Params
from rlhf_pipeline.ppo import Checkpointer, PolicyWithValue, PPOTrainer
from rlhf_pipeline.sampling import hidden_from
from rlhf_pipeline.reward import RewardModel

REPO = Path(__file__).resolve().parents[1]
# No truncation token: the tiny random model rarely samples '.', and we want real RM scores.
TASK = {"response_length": 6, "truncate_token": None, "temperature": 0.7}
PPO = {"total_episodes": 64, "batch_size": 16, "nminibatches": 2, "microbatch_size": 4, "checkpoint_every": 2, "lr": 1.0e-3}


def make_params(**ppo) -> Params:
    return Params.model_validate({"task": TASK, "ppo": {**PPO, **ppo}})


@pytest.fixture(scope="module")
def reward_model(tiny_base_dir):
    tokenizer = load_tokenizer(tiny_base_dir)
    return RewardModel.from_base(tiny_base_dir, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0)).eval()


@pytest.fixture(scope="module")
def queries(tiny_base_dir):
    pad = load_tokenizer(tiny_base_dir).pad_token_id
    q = torch.randint(0, 250, (40, 5), generator=torch.Generator().manual_seed(0))
    q[:8, :2] = pad  # some left padding
    return q


def make_trainer(tiny_base_dir, reward_model, queries, params: Params, checkpoint_dir=None, log=None):
    torch.manual_seed(params.seed)
    tokenizer = load_tokenizer(tiny_base_dir)
    if params.ppo.value_model == "shared":
        policy = PolicyWithValue(load_causal_lm(tiny_base_dir))
    else:
        policy = PolicyWithValue(load_causal_lm(tiny_base_dir), reward_model.backbone.__class__.from_pretrained(tiny_base_dir), torch.nn.Linear(64, 1))
    checkpointer = Checkpointer(checkpoint_dir, "test") if checkpoint_dir else None
    return PPOTrainer(policy, load_causal_lm(tiny_base_dir), reward_model, queries, params.task, params.ppo, tokenizer, params.seed, torch.device("cpu"), checkpointer=checkpointer, log=log)


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
    # LR annealed linearly to 0 across updates: update u uses lr * (1 - u / U)
    assert [r["lr"] for r in h1] == pytest.approx([1e-3 * (1 - u / 4) for u in range(4)])


def test_frozen_layers_train_only_the_top(tiny_base_dir, reward_model, queries):
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(freeze_layers=1, total_episodes=32))
    assert trainer.use_trunk
    bottom = trainer.policy.lm.model.layers[0].mlp.up_proj.weight.detach().clone()
    top = trainer.policy.lm.model.layers[1].mlp.up_proj.weight.detach().clone()
    history = trainer.train(progress=False)
    assert torch.equal(bottom, trainer.policy.lm.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(top, trainer.policy.lm.model.layers[1].mlp.up_proj.weight)
    # the first minibatch of the first epoch sees ratio == 1 only if the trunk path is exact
    assert abs(history[0]["policy/ratio_mean"] - 1.0) < 0.05


def test_separate_value_model_runs(tiny_base_dir, reward_model, queries):
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(value_model="separate", total_episodes=16))
    history = trainer.train(progress=False)
    assert len(history) == 1 and all(v == v for v in history[0].values() if isinstance(v, float))


def test_resume_after_crash_is_bit_identical(tiny_base_dir, reward_model, queries, tmp_path):
    params = make_params()
    reference = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "uninterrupted")
    reference.train(progress=False)

    class Crash(Exception):
        pass

    def crash_after_update_3(record):
        if record["update"] == 3:
            raise Crash

    crashing = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "crashed", log=crash_after_update_3)
    with pytest.raises(Crash):
        crashing.train(progress=False)
    assert json.loads((tmp_path / "crashed/state/meta.json").read_text())["update"] == 2
    resumed = make_trainer(tiny_base_dir, reward_model, queries, params, tmp_path / "crashed")
    history = resumed.train(progress=False)
    assert resumed.start_update == 2 and len(history) == 4
    for (name, a), b in zip(reference.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoint_with_other_fingerprint_starts_fresh(tmp_path):
    (tmp_path / "state").mkdir(parents=True)
    (tmp_path / "state/meta.json").write_text(json.dumps({"fingerprint": "old", "update": 3}))
    assert Checkpointer(tmp_path, "new").prepare() is False
    assert not (tmp_path / "state").exists()


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tiny_base_dir, reward_model, queries, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_base_dir, reward_model, queries, make_params(), tmp_path / "ck")
    real_optimize = trainer.optimize

    def poisoned(ro, advantages, returns, update):
        if update == 2:
            advantages = advantages * float("nan")
        return real_optimize(ro, advantages, returns, update)

    monkeypatch.setattr(trainer, "optimize", poisoned)
    with pytest.raises(NonFiniteError, match="non-finite"):
        trainer.train(progress=False)
    assert json.loads((tmp_path / "ck/state/meta.json").read_text())["update"] == 2


def test_stop_at_eos_masks_tokens_after_eos(tiny_base_dir, reward_model, queries):
    params = Params.model_validate({"task": {**TASK, "stop_at_eos": True, "temperature": 3.0, "response_length": 12}, "ppo": {**PPO, "total_episodes": 16}})
    trainer = make_trainer(tiny_base_dir, reward_model, queries, params)
    eos = trainer.tokenizer.eos_token_id
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
    reward_model.save(root / "models/reward")
    load_tokenizer(tiny_base_dir).save_pretrained(root / "models/reward")
    rows = {"query_ids": queries.tolist(), "query": ["q"] * len(queries)}
    DatasetDict({"train": Dataset.from_dict(rows), "test": Dataset.from_dict(rows)}).save_to_disk(str(root / "data/queries"))
    params = {"task": TASK, "ppo": {**PPO, "total_episodes": 160, "checkpoint_every": 2, "device": "cpu"}, "data": {"preferences": {"source": "user.jsonl"}}}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    add_pipeline_definition(root)
    return root


def run_stage(root: Path, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    for item in ("models", "data", "params.yaml", "dvc.yaml"):
        if not (out / item).exists():
            (shutil.copytree if (root / item).is_dir() else shutil.copy)(root / item, out / item)
    env = {**os.environ, "RLHF_PROJECT_ROOT": str(out), "GIT_DIR": "/nonexistent"}
    return subprocess.Popen([sys.executable, str(REPO / "stages/train_policy.py")], cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed/models/policy").exists(), "killed before the final model was written"
    killed_at = json.loads(meta.read_text())["update"]
    assert killed_at < 10

    rerun = run_stage(policy_project, tmp_path / "killed")
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    assert "resuming from update" in output
    a = (tmp_path / "whole/models/policy/model.safetensors").read_bytes()
    b = (tmp_path / "killed/models/policy/model.safetensors").read_bytes()
    assert a == b, "resumed weights differ from an uninterrupted run"


def test_data_parallel_run_with_two_processes(policy_project, tmp_path):
    """`torchrun --nproc_per_node 2` (what `accelerate launch` sets up): gloo DDP on CPU, each
    rank rolls out half the batch, only rank 0 writes the model and metrics."""
    out = tmp_path / "ddp"
    for item in ("models", "data", "params.yaml", "dvc.yaml"):
        (shutil.copytree if (policy_project / item).is_dir() else shutil.copy)(policy_project / item, out / item)
    params = yaml.safe_load((out / "params.yaml").read_text())
    params["ppo"]["total_episodes"] = 32
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "RLHF_PROJECT_ROOT": str(out), "GIT_DIR": "/nonexistent", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", "29533", str(REPO / "stages/train_policy.py")],
                            cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((out / "metrics/policy.json").read_text())
    assert metrics["episodes"] == 32 and metrics["updates"] == 2
    assert (out / "models/policy/model.safetensors").is_file()
