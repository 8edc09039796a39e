"""Shared fixtures: a tiny base model materialised like stages/base_model.py does it, and helpers
to run a stage script in a temporary project directory."""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: the suite runs offline, like the stages)

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

# `import dvc` binds DVC's log handlers to the sys.stdout/sys.stderr of that moment, and they raise
# (LoggingException) once that stream is closed. Imported here, they get pytest's session-long streams;
# imported first inside a test using capsys, they would keep its stream, closed when that test ends, and
# the next in-process DVC warning (the flow's checkout, say) would crash a later test.
import dvc  # noqa: F401
import pytest
import torch
import yaml
from system_packages import unavailable

torch.set_num_threads(1)  # the test machine has 2 shared cores
if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs a worker per core: the stages it starts get one thread too
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
# modules of a minute or more (measured on 2 cores), longest first: collected first, so that under
# `--dist loadfile --no-loadscope-reorder` (`make test`; without that flag xdist sorts modules by their
# number of tests and these few-test modules would start last) xdist hands them out first and the
# short modules fill in around them, instead of one long module starting last and running alone at the
# end. test_flow needs the tiny run only at its end, by when test_pipeline_e2e's worker has built it.
LONG_MODULES = (
    "test_pipeline_e2e",
    "test_flow",
    "test_prefect_worker",
    "test_distributed",
    "test_label_studio",
    "test_registry",
    "test_base_model",
    "test_remote_ssh",
    "test_numerics",
    "test_labelling",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))  # stable


# The tiers mean what they say: a test outside `e2e` runs no stage or pipeline, starts no server and
# drives no browser. What each of those starts, as a word of its command line; a test that starts one
# without the marker fails, naming the command (so `pytest -m "not e2e"` stays the quick tier).
def e2e_command(args) -> str | None:
    """What ``args`` (a command line) starts that only e2e tests may start, or None."""
    tokens = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    names = {Path(t).name for t in tokens}
    stage_scripts = [t for t in tokens if t.endswith(".py") and (t.startswith("stages/") or "/stages/" in t)]
    # a stage's script, or a driver handed the stages' folder
    if stage_scripts or any(t.rstrip("/").endswith("/stages") for t in tokens):
        return "a pipeline stage"
    if "repro" in tokens:
        return "dvc repro"
    if "uvicorn" in tokens or ("prefect" in names and {"server", "worker"} & set(tokens)):
        return "a Prefect server or worker"
    for program, what in {
        "postgres": "PostgreSQL",
        "pg_ctl": "PostgreSQL",
        "initdb": "PostgreSQL",
        "sshd": "an SSH server",
        "chromium": "Chromium",
        "chrome": "Chromium",
        "label-studio": "Label Studio",
        "accelerate": "accelerate launch",
    }.items():
        if program in names:
            return what
    return None


_outside_e2e: list[str] = []  # the running test's id while it is outside the e2e tier


def refuse_outside_e2e(what: str) -> None:
    if _outside_e2e:
        raise AssertionError(
            f"{_outside_e2e[0]} runs {what} but is not marked e2e: mark it (`@pytest.mark.e2e`, or the module's "
            "pytestmark), so that `pytest -m 'not e2e'` runs no stage, pipeline, server or browser"
        )


# fixtures that run the pipeline or a stage, or start a server or a browser (shared: set up before a
# test's own fixtures, so the command guard below would not see them start)
E2E_FIXTURES = {
    "tiny_run": "the tiny pipeline",
    "versioned": "the tiny pipeline",
    "stage_run": "the base_model stage",
    "reward_runs": "accelerate launch",
    "policy_runs": "accelerate launch",
    "prefect_server": "a Prefect server",
    "chromium": "Chromium",
    "label_studio": "Label Studio",
    "servers": "HTTP servers",
}


@pytest.fixture(autouse=True)
def _tiers_mean_what_they_say(request, monkeypatch):
    if request.node.get_closest_marker("e2e") is not None:
        yield
        return
    for name in set(E2E_FIXTURES) & set(request.fixturenames):
        _outside_e2e.append(request.node.nodeid)
        try:
            refuse_outside_e2e(f"{E2E_FIXTURES[name]} (fixture `{name}`)")
        finally:
            _outside_e2e.clear()
    real_init = subprocess.Popen.__init__

    def guarded_init(self, args, *rest, **kwargs):
        what = e2e_command(args)
        if what is not None:
            line = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            refuse_outside_e2e(f"{what} (`{line[:160]}`)")
        real_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_init)
    _outside_e2e.append(request.node.nodeid)
    try:
        yield
    finally:
        _outside_e2e.clear()


# A stage script's first import is stages/_interpreter.py, found because Python puts a script's folder
# first on sys.path; the stages run in-process here (runpy, importlib) need that folder too. Appended,
# not prepended: stages/evaluate.py must not shadow a library module of that name.
sys.path.append(str(REPO / "stages"))
PAD_TOKEN = "<|pad|>"


def materialize_tiny_base(directory: str | os.PathLike, warm_up: bool = True) -> Path:
    """models/base for the tiny model, built in a child process under the portable numerics pin
    (AVX2 kernels, 1 thread), as the base_model stage builds it: the warm-up trains the model, and
    trained unpinned in this process it would be another model on a CPU that dispatches otherwise
    (under ATEN_CPU_CAPABILITY=default it samples a control character that the data contract
    refuses). The pin must precede the first torch kernel, which this process has long since run."""
    directory = Path(directory)
    builder = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from rlhf_pipeline import numerics; numerics.pin('portable', 1);"
        "import conftest; conftest.materialize_tiny_base_here(sys.argv[2], sys.argv[3] == 'warm')"
    )
    arguments = [str(REPO / "tests"), str(directory), "warm" if warm_up else "cold"]
    subprocess.run([sys.executable, "-c", builder, *arguments], check=True)
    return directory


def materialize_tiny_base_here(directory: str | os.PathLike, warm_up: bool = True) -> Path:
    """materialize_tiny_base's body, in the calling process: build_tiny_model, load it as the
    base_model stage loads a local source, (warm it up), add the dedicated pad token, save with its
    SHA256SUMS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_pipeline.io import write_checksums
    from rlhf_pipeline.sources import add_dedicated_pad_token, build_tiny_model, warm_up

    directory = Path(directory)
    source = build_tiny_model(directory.parent / f"{directory.name}-source")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if warm_up:
        warm_up(model, tokenizer)
    add_dedicated_pad_token(model, tokenizer, PAD_TOKEN)
    model.eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    write_checksums(directory)
    return directory


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server per test process, for every module that runs flows (a second
    harness in the same process would leave Prefect's event worker sending task-run records to the
    first server, where the second's client never finds them)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def chromium() -> str:
    """Chromium from the distribution's packages, installed here when missing (root + apt-get);
    the browser tests are skipped, with the reason, only where it cannot be had."""
    from headless_browser import find_or_install_chromium

    executable, why = find_or_install_chromium()
    if executable is None:
        unavailable(why)
    return executable


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory) -> Path:
    """Path of a tiny base model directory (config, weights, tokenizer with a dedicated pad)."""
    return materialize_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


# ChatML, as SmolLM2-Instruct and many chat models write conversations
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_base_dir(tiny_base_dir, tmp_path_factory) -> Path:
    """The tiny base model with a chat template: ChatML's two markers added as special tokens
    (embedding rows appended) and the template saved with the tokenizer."""
    from rlhf_pipeline.io import write_checksums
    from rlhf_pipeline.models import load_causal_lm, load_tokenizer

    directory = tmp_path_factory.mktemp("tiny_chat") / "base"
    model, tokenizer = load_causal_lm(tiny_base_dir), load_tokenizer(tiny_base_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    tokenizer.chat_template = CHATML
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    write_checksums(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_base_dir):
    from rlhf_pipeline.models import load_tokenizer

    return load_tokenizer(tiny_base_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_base_dir):
    from rlhf_pipeline.models import load_causal_lm

    return load_causal_lm(tiny_base_dir).eval()


def add_pipeline_definition(root: str | os.PathLike) -> None:
    """Copy the repo's dvc.yaml into ``root``: stages read only the params it declares for them,
    so a stage runs in a test project under the same restriction as under `dvc repro`."""
    shutil.copy(REPO / "dvc.yaml", Path(root) / "dvc.yaml")


def sampling_request(queries, query_mask, response_length, temperature, pad_token_id, generator=None, **fields):
    """A :class:`~rlhf_pipeline.decoding.SamplingRequest` from the arguments in their old positional order."""
    from rlhf_pipeline.decoding import SamplingRequest

    return SamplingRequest(
        queries=queries,
        query_mask=query_mask,
        response_length=response_length,
        temperature=temperature,
        pad_token_id=pad_token_id,
        generator=generator,
        **fields,
    )


def tiny_params(**overrides) -> dict:
    """A params.yaml mapping sized for the tiny model; ``overrides`` are dotted keys."""
    params = {
        "seed": 1,
        # stages run in the test's own process here, whose kernels are already chosen: native keeps them
        # (tests hold on any CPU by construction); `make test` runs a worker per core
        "compute": {"cpu_numerics": "native", "cpu_threads": 1},
        "data": {
            "corpus": {"source": "generated", "num_passages": 12, "passage_tokens": 24, "batch_size": 6},
            "queries": {"query_length": 16, "test_fraction": 0.25, "min_test_queries": 1},
            "preferences": {"num_samples": 4, "num_labels": 8, "num_test_labels": 4, "batch_size": 4},
            "validation": {"min_rows": 4, "max_label_share": 1.0},
        },
        "task": {"response_length": 8, "truncate_after": 4},
        "reward": {"train": {"batch_size": 4, "microbatch_size": 4}},
    }
    for dotted, value in overrides.items():
        node = params
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return params


def full_params(partial: dict) -> dict:
    """``partial`` with every other key at its schema default, spelled out: DVC (and so the stage
    runner) reads each tracked key from the file itself."""
    from rlhf_pipeline.params.schema import parse_params

    return parse_params(partial).model_dump(mode="json")


class Project(type(Path())):
    """The temporary project root; ``write_params(**dotted_overrides)`` rewrites params.yaml."""

    def write_params(self, **overrides) -> Path:
        path = self / "params.yaml"
        path.write_text(yaml.safe_dump(full_params(tiny_params(**overrides))))
        return path


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_base_dir) -> Project:
    """A temporary project root (the cwd) with models/base -> the tiny model and a tiny params.yaml."""
    root = Project(tmp_path)
    (root / "models").mkdir()
    (root / "models" / "base").symlink_to(tiny_base_dir, target_is_directory=True)
    add_pipeline_definition(root)
    monkeypatch.chdir(root)
    root.write_params()
    return root


def run_stage_script(name: str, argv: list[str] | None = None) -> int:
    """Run ``stages/<name>.py`` as ``__main__`` in-process (cwd = the project); returns the exit code."""
    refuse_outside_e2e(f"the stage {name} (in-process)")
    old_argv = sys.argv
    sys.argv = [f"stages/{name}.py", *(argv or [])]
    try:
        runpy.run_path(str(REPO / "stages" / f"{name}.py"), run_name="__main__")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        sys.argv = old_argv
    return 0


def build_tiny_run(parent: Path, tiny_base_dir: Path) -> subprocess.CompletedProcess:
    """The tiny pipeline run once in ``parent``/tiny-run (the params each stage read recorded in
    tiny-run-reads beside it), committed, with a local DVC remote in ``parent``/remote."""
    from test_pipeline_e2e import build_project, sh

    from rlhf_pipeline.runner import RECORD_READS_ENV

    (parent / "tiny-run").mkdir()
    root = build_project(parent / "tiny-run", tiny_base_dir, {})
    sh(["dvc", "remote", "add", "-d", "local", str(parent / "remote")], root)
    result = sh(["dvc", "repro"], root, **{RECORD_READS_ENV: str(parent / "tiny-run-reads")})
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "repro"], root)
    return result


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_base_dir):
    """The tiny pipeline run once and committed, with a local DVC remote; returns (root, the `dvc
    repro` result). A run costs about two minutes here, so every module shares one: under xdist the
    first worker to need it builds it (the others wait on a file lock) and each worker works on its
    own copy, its remote its own (the commit amended: clones of the copy read .dvc/config from git).
    Each test reads the copy or copies it again before changing anything."""
    from filelock import FileLock
    from test_pipeline_e2e import sh

    from rlhf_pipeline.io import atomic_file

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    shared = tmp_path_factory.getbasetemp().parent / "tiny-run-shared" if worker else tmp_path_factory.mktemp("tiny")
    with FileLock(f"{shared}.lock"):
        record = shared / "repro.json"
        if not record.exists():
            shutil.rmtree(shared, ignore_errors=True)  # a build cut off in an earlier worker
            shared.mkdir(parents=True)
            result = build_tiny_run(shared, tiny_base_dir)
            fields = {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}
            with atomic_file(record) as out:  # written last: its presence says the build finished
                json.dump(fields, out)
    root = shared / "tiny-run"
    if worker is not None:
        parent = tmp_path_factory.mktemp("tiny-run-copy")
        for name in ("tiny-run", "tiny-run-reads", "remote"):
            if (shared / name).exists():  # the remote only once something was pushed
                shutil.copytree(shared / name, parent / name, symlinks=True)
        root = parent / "tiny-run"
        sh(["dvc", "remote", "modify", "local", "url", str(parent / "remote")], root)
        sh(["git", "commit", "-q", "--amend", "--no-edit", "--", ".dvc/config"], root)
    done = json.loads(record.read_text())
    return root, subprocess.CompletedProcess(["dvc", "repro"], done["returncode"], done["stdout"], done["stderr"])


@pytest.fixture(scope="session")
def versioned(tiny_run):
    """The tiny run as the registry sees it: HEAD's policy is the first candidate
    (tests/test_registry.py and the flow's gate test copy it)."""
    return tiny_run[0]
