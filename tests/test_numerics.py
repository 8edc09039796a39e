"""compute.cpu_numerics: the pin (rlhf_pipeline/numerics.py), its refusals, and the same bytes on two
hosts as this machine can fake them (another kernel dispatch, another thread count)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, add_pipeline_definition, full_params, tiny_params

from rlhf_pipeline import numerics
from rlhf_pipeline.errors import ParamsError
from rlhf_pipeline.params.schema import parse_params
from rlhf_pipeline.runner import declared_keys_by_stage

# the stages that run a model: each pins compute.cpu_numerics before its first torch operation
MODEL_STAGES = {"base_model", "corpus", "preferences", "train_reward", "normalize_reward", "train_policy", "evaluate"}


@pytest.fixture
def clean_pin(monkeypatch):
    """Whatever a test pins is forgotten afterwards, and torch keeps this worker's thread count."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(numerics, "_pinned", None)
    yield
    torch.set_num_threads(threads)


def test_portable_sets_every_variable_and_says_which_of_the_user_s_it_replaced(clean_pin, monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    environ = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "16", "HOME": "/root"}
    pin = numerics.pin("portable", 1, environ)
    assert environ == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HOME": "/root",
    }
    assert pin.overridden == {"ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": "16"}
    said = capsys.readouterr().out
    assert "ATEN_CPU_CAPABILITY=avx512" in said and "OMP_NUM_THREADS=16" in said and "native" in said
    assert "MKL_CBWR" not in said  # the user's value was the pinned one
    assert torch.get_num_threads() == 1 and numerics.pinned() is pin
    # the record is the same on every host (so is a model card that carries it)
    assert pin.record() == {
        "mode": "portable",
        "level": "AVX2",
        "threads": 1,
        "variables": numerics.PINNED_ENVIRONMENTS["portable"],
    }
    assert "portable: AVX2 kernels, 1 torch threads" in numerics.describe(pin.record())


def test_compatible_moves_mkl_to_its_compatible_branch(clean_pin, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    environ: dict[str, str] = {}
    pin = numerics.pin("compatible", 1, environ)
    assert environ["MKL_CBWR"] == "COMPATIBLE" and environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert pin.record()["variables"]["MKL_CBWR"] == "COMPATIBLE" and pin.record()["mode"] == "compatible"


def test_native_leaves_the_environment_alone_and_records_the_host(clean_pin, capsys):
    environ = {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "3"}
    pin = numerics.pin("native", None, environ)
    assert environ == {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "3"}
    assert capsys.readouterr().out == ""
    record = pin.record()
    assert record["mode"] == "native" and record["capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["threads"] == torch.get_num_threads()


def test_a_host_without_avx2_is_refused_with_exit_2(clean_pin, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(numerics, "host_has_avx2", lambda: False)
    with pytest.raises(numerics.NumericsError) as refused:
        numerics.pin("portable", 1, {})
    assert refused.value.exit_code == 2
    message = str(refused.value)
    assert "lacks" in message and "compute.cpu_numerics: native" in message and "DEFAULT" in message
    assert numerics.pinned() is None


def test_a_kernel_run_before_the_pin_is_named_as_the_entry_point_s_bug(clean_pin, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(numerics, "host_has_avx2", lambda: True)
    with pytest.raises(numerics.NumericsError, match="one ran before the pin"):
        numerics.pin("portable", 1, {})


@pytest.mark.parametrize("mode", ["portable", "compatible"])
def test_a_pin_without_a_thread_count_is_refused_naming_the_key(mode):
    with pytest.raises(ParamsError) as refused:
        parse_params({"compute": {"cpu_numerics": mode, "cpu_threads": None}})
    assert any(line.startswith("compute.cpu_threads: must be a number") for line in refused.value.problems)
    assert parse_params({"compute": {"cpu_numerics": "native", "cpu_threads": None}}).compute.cpu_threads is None


def test_every_stage_that_runs_a_model_declares_compute_and_pins_it():
    """dvc.yaml declares `compute` for exactly the stages whose schema has it (the runner pins it for
    those), and those are the stages that run a model: a change of numerics reruns them all."""
    import runpy

    declared = {name for name, keys in declared_keys_by_stage(REPO).items() if keys is None or "compute" in keys}
    with_schema = set()
    for script in sorted((REPO / "stages").glob("[!_]*.py")):
        schema = runpy.run_path(str(script), run_name="not_main")["Params"]
        if "compute" in schema.model_fields:
            with_schema.add(script.stem)
    assert declared == with_schema == MODEL_STAGES


# --------------------------------------------------------------------------------------------
# two hosts, as this machine fakes them: another kernel dispatch and another thread count
# --------------------------------------------------------------------------------------------
STAGES = ("corpus", "queries", "preferences", "validate_preferences", "train_reward")
OUTPUTS = ("data/corpus", "data/queries", "data/preferences", "models/reward_unnormalized")
HOSTS = {
    "avx2, 1 thread": {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"},
    "default, 2 threads": {
        "ATEN_CPU_CAPABILITY": "default",
        "OMP_NUM_THREADS": "2",
    },
}
# one process runs the stages in order, as `dvc repro` would one after the other (imports paid once)
DRIVER = """
import runpy, sys
sys.path.append(sys.argv[1])
for name in sys.argv[2:]:
    sys.argv = [f"stages/{name}.py"]
    try:
        runpy.run_path(f"{sys.path[-1]}/{name}.py", run_name="__main__")
    except SystemExit as stop:
        if stop.code:
            raise
"""


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    assert files, f"{folder}: the stage wrote nothing there"
    for path in files:
        digest.update(f"{path.relative_to(folder)}\0".encode() + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def run_as_host(template: Path, where: Path, host: dict[str, str]) -> tuple[dict[str, str], str]:
    shutil.copytree(template, where, symlinks=True)
    env = {key: value for key, value in os.environ.items() if key not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(REPO / "stages"), *STAGES],
        cwd=where,
        env={**env, **host, "RLHF_PROJECT_ROOT": str(where)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {out: folder_digest(where / out) for out in OUTPUTS}, result.stdout


@pytest.mark.parametrize("mode", ["portable", "native"])
@pytest.mark.e2e
def test_two_hosts_make_the_same_bytes_under_portable_and_their_own_under_native(mode, tmp_path, tiny_base_dir):
    template = tmp_path / "project"
    (template / "models").mkdir(parents=True)
    (template / "models" / "base").symlink_to(tiny_base_dir, target_is_directory=True)
    add_pipeline_definition(template)
    threads = 1 if mode == "portable" else None  # native: each host's own thread count
    # no reward normalisation before training: on a CPU whose tiny model keeps a single train query (an
    # Intel Xeon did), its one sampled response has no spread to normalise, and the stage rightly refuses
    params = full_params(
        tiny_params(
            **{"compute.cpu_numerics": mode, "compute.cpu_threads": threads, "reward.train.normalize_before": False}
        )
    )
    (template / "params.yaml").write_text(yaml.safe_dump(params))
    (first, _), (second, said) = (
        run_as_host(template, tmp_path / name.replace(", ", "-").replace(" ", "_"), host)
        for name, host in HOSTS.items()
    )
    differing = sorted(out for out in OUTPUTS if first[out] != second[out])
    if mode == "portable":
        assert differing == []
        assert "ATEN_CPU_CAPABILITY=default" in said and "OMP_NUM_THREADS=2" in said  # and the user is told
        card = (tmp_path / "default-2_threads" / "models/reward_unnormalized/README.md").read_text()
        assert "cpu numerics: portable: AVX2 kernels, 1 torch threads" in card
    else:
        # the hosts' kernels round differently, so the trained weights differ
        assert "models/reward_unnormalized" in differing


def test_rlhf_environment_pins_what_params_ask_and_reads_back_what_torch_and_mkl_run(tmp_path):
    (tmp_path / "params.yaml").write_text("compute:\n  cpu_numerics: portable\n  cpu_threads: 1\n")
    rlhf = [str(Path(sys.executable).parent / "rlhf"), "environment", "--root", str(tmp_path)]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    shown = subprocess.run(rlhf, capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "wins over your environment's ATEN_CPU_CAPABILITY=default" in shown.stdout
    assert "cpu numerics: portable: AVX2 kernels, 1 torch threads" in shown.stdout
    assert "this process: torch runs AVX2 kernels on 1 threads, MKL runs its " in shown.stdout
