"""compute.device: the one device rule (rlhf_pipeline/devices.py), with and without a GPU, and every
stage that runs a model going through it."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
from conftest import run_stage_script, sampling_request
from test_numerics import MODEL_STAGES

from rlhf_pipeline import devices
from rlhf_pipeline.errors import ParamsError
from rlhf_pipeline.params.schema import parse_params
from rlhf_pipeline.sampling import samples_statically

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch as it looks on a host with CUDA GPUs, without one: what resolve_device asks and sets,
    each restored after the test."""
    set_devices, deterministic = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU 80GB")
    monkeypatch.setattr(torch.cuda, "set_device", set_devices.append)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, warn_only=False: deterministic.append(on))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    # torch's backend flags are properties of module objects: saved and put back by hand
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    yield set_devices, deterministic
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = flags


def test_auto_without_a_gpu_is_the_cpu_in_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = devices.resolve_device("auto")
    assert plan.device == torch.device("cpu") and plan.autocast_dtype is None
    assert plan.describe() == "cpu (fp32)"
    with plan.autocast():  # a no-op on the CPU: fp32 stays fp32
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_auto_with_a_gpu_is_the_local_rank_s_gpu_in_bf16_autocast_and_deterministic(fake_gpu, monkeypatch):
    set_devices, deterministic = fake_gpu
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second process of `accelerate launch`
    plan = devices.resolve_device("auto")
    assert plan.device == torch.device("cuda", 1) and set_devices == [1]
    assert plan.autocast_dtype == torch.bfloat16
    assert plan.describe() == "Fake GPU 80GB (bf16 autocast, fp32 weights, TF32; static-cache sampler)"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == devices.CUBLAS_WORKSPACE
    assert deterministic == [True] and torch.backends.cudnn.benchmark is False


def test_cuda_precision_fp32_turns_off_autocast_and_tf32(fake_gpu):
    plan = devices.resolve_device("cuda", "fp32", sampler="eager")
    assert plan.device.type == "cuda" and plan.autocast_dtype is None
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert plan.describe() == "Fake GPU 80GB (fp32, no TF32; eager sampler)"


def test_a_gpu_without_bf16_falls_back_to_fp32_and_says_so(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # e.g. a V100
    assert devices.resolve_device("auto", "bf16").describe() == "Fake GPU 80GB (fp32, no TF32; static-cache sampler)"


def test_cpu_on_a_gpu_host_is_the_cpu_and_leaves_the_gpu_settings_alone(fake_gpu):
    set_devices, deterministic = fake_gpu
    plan = devices.resolve_device("cpu")
    assert plan.device == torch.device("cpu") and plan.autocast_dtype is None
    assert set_devices == [] and deterministic == [] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_not_deterministic_when_ppo_asks_so(fake_gpu):
    _, deterministic = fake_gpu
    devices.resolve_device("cuda", deterministic=False)
    assert deterministic == [] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_cuda_without_a_gpu_is_exit_2_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(devices.DeviceError) as refused:
        devices.resolve_device("cuda")
    assert refused.value.exit_code == 2
    message = str(refused.value)
    assert "compute.device is 'cuda'" in message and "auto" in message and "cpu" in message


@pytest.mark.e2e
def test_a_stage_asked_for_cuda_on_a_cpu_host_stops_with_exit_2_before_loading(project, capsys):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: compute.device cuda is valid here")
    project.write_params(**{"compute.device": "cuda"})
    assert run_stage_script("corpus") == 2
    err = capsys.readouterr().err
    assert "compute.device is 'cuda'" in err
    assert not (project / "data/corpus").exists()  # nothing written


def test_ppo_device_from_an_older_params_file_is_told_where_it_moved():
    with pytest.raises(ParamsError) as refused:
        parse_params({"ppo": {"device": "cuda"}})
    assert any(line.startswith("ppo.device: this key moved to compute.device") for line in refused.value.problems), (
        refused.value.problems
    )


def stage_calls(name: str) -> set[str]:
    tree = ast.parse((REPO / "stages" / f"{name}.py").read_text())
    return {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


def test_every_stage_that_runs_a_model_resolves_its_device_through_the_one_rule():
    """Each stage that samples, scores or trains calls resolve_device (base_model only dequantises
    and saves, on the CPU); none builds a torch.device of its own."""
    for name in MODEL_STAGES - {"base_model"}:
        assert "resolve_compute" in stage_calls(name), name
        assert "torch.device(" not in (REPO / "stages" / f"{name}.py").read_text(), name


def test_the_static_sampler_takes_cuda_calls_it_can_serve_unless_the_plan_says_eager(fake_gpu):
    """The sampler is chosen where the device plan is made (compute.cuda_sampler) and passed in: no module
    keeps it, so two plans in one process each sample as they say."""

    class OnGpu:  # queries on a GPU, as far as the choice looks at them
        device = torch.device("cuda", 0)

    def request(device=None, **fields):
        asked = sampling_request(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), 4, 0.7, 0)
        for name, value in fields.items():
            setattr(asked, name, value)
        if device == "cuda":
            asked.queries = OnGpu()
        return asked

    static = devices.resolve_device("cuda")  # compute.cuda_sampler: static, the default
    assert static.sampler == "static" and samples_statically(request("cuda"), static.sampler)
    assert not samples_statically(request(), static.sampler)  # the CPU samples eagerly: nothing to replay there
    # the trunk split's captured layer, one of two processes' share, draws given by the caller
    for asked in ({"capture_layers": (20,)}, {"process_share": (0, 2)}, {"uniforms": torch.zeros(2, 4)}):
        assert not samples_statically(request("cuda", **asked), static.sampler), asked
    eager = devices.resolve_compute(parse_params({"compute": {"cuda_sampler": "eager"}}).compute)
    assert eager.sampler == "eager" and not samples_statically(request("cuda"), eager.sampler)
    assert samples_statically(request("cuda"), static.sampler)  # the first plan samples as it did
    assert "static-cache sampler" in static.describe() and "eager sampler" in eager.describe()


def test_the_sampler_names_are_the_schema_s():
    """compute.cuda_sampler's values (a Literal of the params schema, which stands below devices) are the
    names the device plan and the samplers compare against (devices.CUDA_SAMPLERS), its default the first."""
    from typing import get_args

    from rlhf_pipeline.params.compute import ComputeParams

    field = ComputeParams.model_fields["cuda_sampler"]
    assert get_args(field.annotation) == devices.CUDA_SAMPLERS and field.default == devices.STATIC_SAMPLER
