"""Two CPU processes (gloo) started by `accelerate launch`, with DDP and with FSDP 2, against one
process over the same global batch: same trained weights, one set of outputs, exact resume after a
``kill -9`` of one process, and configurations the code cannot honour refused before training."""

from __future__ import annotations

import contextlib
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
from safetensors.torch import load_file
from test_ppo import policy_project, queries, reward_model  # noqa: F401  (the tiny PPO project fixtures)

from rlhf_pipeline import distributed
from rlhf_pipeline.distributed import lost_processes_reported, make_accelerator, refuse_unsupported
from rlhf_pipeline.errors import NOT_RETRIED_EXIT_CODES, LostProcessError, PipelineError

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
# accelerate's flags; on a machine without GPUs --multi_gpu starts the processes on gloo (CPU)
LAUNCH = {
    "ddp": ["--multi_gpu"],
    "fsdp": [
        "--use_fsdp",
        "--fsdp_version",
        "2",
        "--fsdp_auto_wrap_policy",
        "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap",
        "LlamaDecoderLayer",
    ],
}
PORTS = {"ddp": 29611, "fsdp": 29623}
# 6 updates of 16 episodes; each process's share of a minibatch (16 / 2 / 2) is one microbatch of 4;
# the lowest block frozen, so the trunk split runs too. The rollout's forwards take 8 rows on one process
# too: a CPU whose products round a row differently in a batch of 16 than of 8 (an Intel Xeon's MKL at
# these widths) would otherwise sample other tokens on one process than on two (docs/distributed.md)
PPO_RUN = {"total_episodes": 96, "checkpoint_every": 1, "freeze_layers": 1, "rollout_microbatch_size": 8}


def launch_env(cwd: Path) -> dict[str, str]:
    return {**os.environ, "RLHF_PROJECT_ROOT": str(cwd), "GIT_DIR": "/nonexistent", "OMP_NUM_THREADS": "1"}


def accelerate_launch(processes: int, machines: int, port: int, kind: str) -> list[str]:
    """`accelerate launch` for ``processes`` processes over ``machines`` machines (add --machine_rank
    when machines > 1), fp32, no compilation."""
    sizes = ["--num_processes", str(processes), "--num_machines", str(machines), "--main_process_port", str(port)]
    return [ACCELERATE, "launch", *sizes, "--mixed_precision", "no", "--dynamo_backend", "no", *LAUNCH[kind]]


def launch(kind: str | None, script: str, *args: str, cwd: Path, popen: bool = False):
    """``script`` as one plain process (kind None) or two through `accelerate launch`."""
    if kind is None:
        command = [sys.executable, script, *args]
    else:
        command = [*accelerate_launch(2, 1, PORTS[kind], kind), script, *args]
    if popen:
        return subprocess.Popen(
            command, cwd=cwd, env=launch_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return subprocess.run(command, cwd=cwd, env=launch_env(cwd), capture_output=True, text=True, timeout=600)


def weights_close(a: Path, b: Path, files: list[str]) -> None:
    for name in files:
        one, other = load_file(str(a / name)), load_file(str(b / name))
        assert one.keys() == other.keys(), name
        for key in one:
            torch.testing.assert_close(other[key], one[key], rtol=1e-4, atol=1e-5, msg=f"{name}:{key}")


# --------------------------------------------------------------------------------------------
# reward-model training (the library function the train_reward stage calls)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_runs(tiny_base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_runs")
    script = str(REPO / "tests/distributed_reward_run.py")
    results = {}
    for kind in (None, "ddp", "fsdp"):
        out = root / (kind or "one")
        results[kind] = launch(kind, script, str(tiny_base_dir), str(out), cwd=root)
        assert results[kind].returncode == 0, results[kind].stdout[-3000:] + results[kind].stderr[-3000:]
    return root, results


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_reward_training_on_two_processes_gives_the_one_process_weights(reward_runs, tiny_base_dir, kind):
    root, _ = reward_runs
    files = ["reward_head.safetensors", "backbone/model.safetensors"]
    weights_close(root / "one", root / kind, files)
    # the per-step loss and accuracy are the global batch's, as on one process
    one, two = (json.loads((root / run / "history.json").read_text()) for run in ("one", kind))
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert b["accuracy"] == a["accuracy"] and b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    # and training moved the weights: the comparison is not of two untouched copies
    trained = load_file(str(root / kind / "backbone/model.safetensors"))
    base = load_file(str(tiny_base_dir / "model.safetensors"))
    assert not torch.allclose(trained["layers.1.mlp.up_proj.weight"], base["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(trained["layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])  # frozen


# --------------------------------------------------------------------------------------------
# PPO: the train_policy stage
# --------------------------------------------------------------------------------------------
def policy_copy(project: Path, out: Path, **ppo) -> Path:
    for item in ("models", "data", "params.yaml", "dvc.yaml"):
        (shutil.copytree if (project / item).is_dir() else shutil.copy)(project / item, out / item)
    params = yaml.safe_load((out / "params.yaml").read_text())
    params["ppo"].update(PPO_RUN, **ppo)
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    return out


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def policy_runs(policy_project, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("policy_runs")
    results = {}
    for kind in (None, "ddp", "fsdp"):
        out = policy_copy(policy_project, root / (kind or "one"))
        results[kind] = launch(kind, str(REPO / "stages/train_policy.py"), cwd=out)
        assert results[kind].returncode == 0, results[kind].stdout[-3000:] + results[kind].stderr[-3000:]
    return root, results


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.e2e
def test_ppo_on_two_processes_gives_the_one_process_policy_and_writes_once(policy_runs, kind):
    root, results = policy_runs
    weights_close(
        root / "one", root / kind, ["models/policy/model.safetensors", "models/policy/value_head.safetensors"]
    )
    one, two = (json.loads((root / run / "metrics/policy.json").read_text()) for run in ("one", kind))
    assert two["updates"] == one["updates"] == 6
    for key in ("score/first_quarter", "score/last_quarter", "kl/last_quarter", "kl_coef/final"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    # only process 0 wrote: the same files as the one-process run, one final line, one DVCLive row per update
    assert files_under(root / kind) == files_under(root / "one")
    assert results[kind].stdout.count("train_policy: 96 episodes") == 1
    rows = (root / kind / "dvclive/train_policy/plots/metrics/objective/score.tsv").read_text().splitlines()
    assert len(rows) == 1 + 6


def worker_pid(project: Path, rank: int) -> int | None:
    """The pid of the training process of ``rank`` working in ``project`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RLHF_PROJECT_ROOT={project}".encode() in environ and f"RANK={rank}".encode() in environ:
            if b"train_policy.py" in (entry / "cmdline").read_bytes():
                return int(entry.name)
    return None


def wait_for_checkpoint(project: Path, update: int) -> Path:
    """Poll until train_policy in ``project`` has checkpointed ``update`` (or 300 s pass); its meta file.
    The tiny run takes its 6 updates within a second: a kill must be timed to a checkpoint."""
    meta = project / "checkpoints/policy/state/meta.json"
    deadline = time.time() + 300
    while time.time() < deadline and not (
        meta.exists() and json.loads(meta.read_text() or "{}").get("update", 0) >= update
    ):
        time.sleep(0.02)
    return meta


@pytest.mark.e2e
def test_a_process_killed_mid_run_resumes_from_the_checkpoint_to_the_same_policy(policy_runs, policy_project):  # noqa: F811
    """FSDP (the state is gathered from the shards and scattered back): ``kill -9`` of process 1
    between checkpoints; the launcher stops the other; a new launch resumes and ends where the
    uninterrupted two-process run ended."""
    root, _ = policy_runs
    out = policy_copy(policy_project, root / "killed")
    victim = launch("fsdp", str(REPO / "stages/train_policy.py"), cwd=out, popen=True)
    meta = wait_for_checkpoint(out, 2)
    pid = worker_pid(out, 1)
    assert pid is not None and not (out / "models/policy").exists(), "the run ended before it could be killed"
    os.kill(pid, signal.SIGKILL)
    output, _ = victim.communicate(timeout=300)
    assert victim.returncode != 0, output[-2000:]
    assert not (out / "models/policy").exists()
    killed_at = json.loads(meta.read_text())["update"]
    assert 2 <= killed_at < 6

    rerun = launch("fsdp", str(REPO / "stages/train_policy.py"), cwd=out)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"resuming from update {killed_at}" in rerun.stdout + rerun.stderr
    weights_close(root / "fsdp", out, ["models/policy/model.safetensors", "models/policy/value_head.safetensors"])


# --------------------------------------------------------------------------------------------
# a lost process: gloo's errors as the stage reports them
# --------------------------------------------------------------------------------------------
class Processes:
    def __init__(self, count: int):
        self.num_processes, self.process_index = count, 0


GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:52460. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "15000ms for recv operation to complete"
)


@pytest.mark.parametrize(
    "reason, said",
    [
        (GLOO_CLOSED, "another process closed its connection (it crashed or was killed"),
        (GLOO_TIMEOUT, "another process did not answer within ppo.collective_timeout_s = 15 s"),
    ],
)
def test_a_lost_process_is_reported_as_a_retried_pipeline_error(reason, said, monkeypatch):
    """The words are gloo's own (measured on torch 2.13 with a killed and a stopped peer); the timeout
    and its key are the ones make_accelerator was given."""
    monkeypatch.setattr(distributed, "_group_timeout", ("ppo.collective_timeout_s", 15.0))
    with pytest.raises(LostProcessError) as caught:
        with lost_processes_reported(Processes(2), "train_policy", "Resume it."):
            raise RuntimeError(reason)
    message = str(caught.value)
    assert message.startswith(f"train_policy: process 0 of 2 stopped because {said}")
    assert "Resume it." in message and reason.splitlines()[0] in message
    assert caught.value.exit_code not in NOT_RETRIED_EXIT_CODES  # another launch can succeed


def test_the_timeout_is_said_once_to_make_accelerator(monkeypatch):
    """The stages give the process group's timeout to make_accelerator alone; a lost process's message
    names that key and value (a process has one process group)."""
    monkeypatch.setattr(distributed, "_group_timeout", distributed._group_timeout)
    make_accelerator(torch.device("cpu"), stage="train_reward", collective_timeout_s=42.0, timeout_key="a.b")
    with pytest.raises(LostProcessError, match=r"did not answer within a\.b = 42 s"):
        with lost_processes_reported(Processes(2), "train_reward", ""):
            raise RuntimeError(GLOO_TIMEOUT)


def test_other_errors_and_a_single_process_pass_unchanged():
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with lost_processes_reported(Processes(2), "train_policy", ""):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # one process has no peers to lose
        with lost_processes_reported(Processes(1), "train_policy", ""):
            raise RuntimeError(GLOO_CLOSED)


# --------------------------------------------------------------------------------------------
# refused before anything trains
# --------------------------------------------------------------------------------------------
def test_zero3_with_the_trunk_split_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(PipelineError, match="ZeRO-3 cannot be combined with the trunk split"):
        refuse_unsupported(torch.device("cuda", 0), trunk_split=True, stage="train_policy")
    refuse_unsupported(torch.device("cuda", 0), trunk_split=False, stage="train_policy")  # ZeRO-3 alone passes
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    refuse_unsupported(torch.device("cuda", 0), trunk_split=True, stage="train_policy")  # ZeRO-2 keeps the split


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
            "accelerate uses DeepSpeed only on GPUs",
        ),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "Add --fsdp_version 2"),
    ],
)
@pytest.mark.e2e
def test_the_stage_refuses_what_it_cannot_honour_before_training(policy_project, tmp_path, env, message):  # noqa: F811
    """The launcher's configuration arrives in the environment; the stage stops with exit code 2
    and its reason before loading a model, and writes nothing."""
    out = policy_copy(policy_project, tmp_path / "refused")
    result = subprocess.run(
        [sys.executable, str(REPO / "stages/train_policy.py")],
        cwd=out,
        env={**os.environ, "RLHF_PROJECT_ROOT": str(out), "GIT_DIR": "/nonexistent", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in result.stderr
    assert not (out / "checkpoints").exists() and not (out / "models/policy").exists()


# --------------------------------------------------------------------------------------------
# two machines of one process each (127.0.0.1 stands in for the network)
# --------------------------------------------------------------------------------------------
NODES_PORT = 29637


def launch_nodes(script: str, *args: str, cwd: Path, port: int = NODES_PORT) -> list[subprocess.Popen]:
    """``script`` on two machines of one process each, as two `accelerate launch` commands (rank 0 the
    main process at 127.0.0.1), each launcher in its own session (see :func:`signal_node`)."""
    command = [*accelerate_launch(2, 2, port, "ddp"), "--main_process_ip", "127.0.0.1"]
    return [
        subprocess.Popen(
            [*command, "--machine_rank", str(rank), script, *args],
            cwd=cwd,
            env=launch_env(cwd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]


def signal_node(launcher: subprocess.Popen, worker: int, sig: int) -> None:
    """``sig`` to every process of one machine: its launcher's session and its training process, which
    torch elastic starts in a session of its own (killing the launcher alone leaves it training)."""
    for send, pid in ((os.killpg, launcher.pid), (os.kill, worker)):
        with contextlib.suppress(ProcessLookupError):  # already gone (a second, clean-up signal)
            send(pid, sig)


def finished(nodes: list[subprocess.Popen]) -> list[str]:
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank}: {output[-3000:]}"
    return outputs


@pytest.mark.e2e
def test_two_machines_of_one_process_train_the_one_process_reward_model(reward_runs, tiny_base_dir):
    root, _ = reward_runs
    finished(
        launch_nodes(str(REPO / "tests/distributed_reward_run.py"), str(tiny_base_dir), str(root / "nodes"), cwd=root)
    )
    weights_close(root / "one", root / "nodes", ["reward_head.safetensors", "backbone/model.safetensors"])
    one, nodes = (json.loads((root / run / "history.json").read_text()) for run in ("one", "nodes"))
    assert [r["accuracy"] for r in nodes] == [r["accuracy"] for r in one]


@pytest.mark.e2e
def test_two_machines_of_one_process_train_the_one_process_policy(policy_runs, policy_project):  # noqa: F811
    """train_policy launched as 2 machines x 1 process (machine ranks 0 and 1, the main process at
    127.0.0.1, gloo): the one-process policy and metrics, written once (the nodes share the folder)."""
    root, _ = policy_runs
    out = policy_copy(policy_project, root / "nodes")
    outputs = finished(launch_nodes(str(REPO / "stages/train_policy.py"), cwd=out))
    weights_close(root / "one", out, ["models/policy/model.safetensors", "models/policy/value_head.safetensors"])
    one, nodes = (json.loads((root / run / "metrics/policy.json").read_text()) for run in ("one", "nodes"))
    for key in ("score/first_quarter", "score/last_quarter", "kl/last_quarter", "kl_coef/final"):
        assert nodes[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert files_under(out) == files_under(root / "one")
    assert sum(output.count("train_policy: 96 episodes") for output in outputs) == 1


@pytest.mark.parametrize(
    "sig, said",
    [
        # a machine that stops answering but keeps its connections open (hung, or cut off): the timeout
        (signal.SIGSTOP, "did not answer within ppo.collective_timeout_s = 10 s"),
        # a machine that goes down: its connections close, the other stops at its next collective
        (signal.SIGKILL, "closed its connection"),
    ],
    ids=["silent", "killed"],
)
@pytest.mark.e2e
def test_a_lost_node_stops_the_other_with_a_clear_error_and_both_resume(policy_runs, policy_project, sig, said):  # noqa: F811
    """Two machines of one process; machine 1 is stopped whole (launcher and training process) after
    the second checkpoint. Machine 0 exits non-zero within the params' timeout, saying what happened
    and that the checkpoint is kept, and writes no policy; launched again, both resume from the
    checkpoint and end on the one-process policy."""
    root, _ = policy_runs
    out = policy_copy(policy_project, root / f"lost_{sig.name}", collective_timeout_s=10.0)
    port = NODES_PORT + (1 if sig == signal.SIGSTOP else 3)
    nodes = launch_nodes(str(REPO / "stages/train_policy.py"), cwd=out, port=port)
    meta = wait_for_checkpoint(out, 2)
    worker = worker_pid(out, 1)
    assert worker is not None and not (out / "models/policy").exists(), "the run ended before a node could be lost"
    signal_node(nodes[1], worker, sig)
    lost_at = time.monotonic()
    try:
        output, _ = nodes[0].communicate(timeout=120)
        waited = time.monotonic() - lost_at
    finally:
        signal_node(nodes[1], worker, signal.SIGKILL)
        nodes[1].communicate(timeout=60)
    assert nodes[0].returncode != 0, output[-3000:]
    assert "LostProcessError" not in output  # the stage's message, not a traceback
    assert f"train_policy: process 0 of 2 stopped because another process {said}" in output, output[-3000:]
    assert "Its last checkpoint in checkpoints/policy is kept" in output
    if sig == signal.SIGSTOP:
        assert 10 <= waited < 70, waited  # the timeout from params, then the launcher's shutdown
    else:
        assert waited < 60, waited
    assert not (out / "models/policy").exists()
    stopped_at = json.loads(meta.read_text())["update"]
    assert 2 <= stopped_at < 6

    outputs = finished(launch_nodes(str(REPO / "stages/train_policy.py"), cwd=out, port=port + 1))
    assert f"resuming from update {stopped_at}" in "".join(outputs)
    weights_close(root / "one", out, ["models/policy/model.safetensors", "models/policy/value_head.safetensors"])
