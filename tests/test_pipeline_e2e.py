"""One end-to-end `dvc repro` of the whole pipeline on a tiny configuration.

The repo's dvc.yaml, stages and library are copied into a fresh git+DVC project whose
params.yaml points base_model.source at a tiny warmed-up Llama; every stage runs for real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from headless_browser import DVC_PLOTS, DVC_PLOTS_DRAWN, HeadlessChromium, page_url
from stage_imports import pipeline_stages, stage_importers

from rlhf_pipeline.modelcard import read_card as read_model_card
from rlhf_pipeline.params.schema import parse_params
from rlhf_pipeline.runner import declared_param_keys

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

ALL_STAGES = {
    "base_model",
    "corpus",
    "queries",
    "preferences",
    "validate_preferences",
    "train_reward",
    "normalize_reward",
    "train_policy",
    "evaluate",
}
TINY_SOURCE = "data/models/tiny"
TINY_PARAMS = {
    "seed": 3,
    "compute": {"device": "cpu", "cpu_numerics": "portable", "cpu_threads": 1},  # written out; a worker per core
    "data": {
        "corpus": {"num_passages": 200, "passage_tokens": 40, "batch_size": 32},
        "queries": {"query_length": 12, "test_fraction": 0.2, "min_test_queries": 8},
        "preferences": {"num_labels": 64, "num_test_labels": 16, "batch_size": 32},
        "validation": {"min_rows": 32},
    },
    "task": {"response_length": 8, "truncate_after": 2},
    "reward": {
        "train": {"batch_size": 16, "microbatch_size": 8, "lr": 1.0e-3, "normalize_before_samples": 16},
        "normalize": {"normalize_samples": 32, "eval_samples": 32, "batch_size": 32},
    },
    "ppo": {
        "total_episodes": 64,
        "batch_size": 16,
        "nminibatches": 2,
        "microbatch_size": 8,
        "freeze_layers": 1,
        "checkpoint_every": 2,
        "lr": 1.0e-4,
    },
    # the curve's checkpoint before the shipped one on the first batch only (evaluate.curve_queries)
    "evaluate": {"num_queries": 16, "batch_size": 8, "curve_queries": 8, "num_table_rows": 8},
}


def sh(args, cwd, check=True, timeout=900, **extra_env):
    env = {
        **os.environ,
        **extra_env,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    if "PATH" in extra_env:  # a caller's own PATH (another interpreter first) wins
        env["PATH"] = extra_env["PATH"]
    env.pop("RLHF_PROJECT_ROOT", None)
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} failed "
            f"({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result


def build_project(root: Path, model_dir: Path, params_overrides: dict) -> Path:
    """A fresh git + DVC project at ``root`` with this repo's pipeline, ``model_dir`` as the local
    base-model source and TINY_PARAMS updated with ``params_overrides`` (every key spelled out)."""
    copied = ("dvc.yaml", "requirements.lock", "stages", "rlhf_pipeline", "data/labels", "data/raw", "data/models")
    for item in (*copied, ".dvcignore"):
        source = REPO / item
        if source.is_dir():
            shutil.copytree(source, root / item, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            (root / item).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, root / item)
    # The source model is a local directory source, where dvc.yaml tracks it.
    shutil.copytree(model_dir, root / TINY_SOURCE)
    params = json.loads(json.dumps(TINY_PARAMS))
    params["base_model"] = {"source": TINY_SOURCE}
    for section, values in params_overrides.items():
        for key, value in values.items():  # one level deeper too: data.corpus, data.preferences, ...
            target = params.setdefault(section, {})
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = {**target[key], **value}
            else:
                target[key] = value
    # DVC tracks params by key, so params.yaml spells out every key (the schema fills defaults).
    (root / "params.yaml").write_text(yaml.safe_dump(parse_params(params).model_dump(mode="json"), sort_keys=False))
    (root / ".gitignore").write_text(f"/models/\n/checkpoints/\n/dvclive/\n/{TINY_SOURCE}/\n")
    sh(["git", "init", "-q"], root)
    sh(["dvc", "init", "-q"], root)
    shutil.copytree(REPO / ".dvc/plots", root / ".dvc/plots")  # custom plot templates and the offline page
    template = sh(["dvc", "config", "--project", "plots.html_template"], REPO).stdout.strip()
    sh(["dvc", "config", "plots.html_template", template], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "tiny project"], root)
    return root


@pytest.fixture
def project(tiny_run):
    """The tiny run (conftest.tiny_run, shared with the registry's tests): read it, or copy it first."""
    return tiny_run


def ran_stages(result) -> set[str]:
    return {line.split("'")[1] for line in result.stdout.splitlines() if line.startswith("Running stage")}


def test_every_stage_ran_and_wrote_its_outputs(project):
    root, result = project
    for stage in ALL_STAGES:
        assert f"Running stage '{stage}'" in result.stdout, stage
    for path in (
        "models/base",
        "models/reward",
        "models/policy",
        "data/preferences",
        "evaluation/report.md",
        "evaluation/overoptimization.png",
        "evaluation/samples.csv",
    ):
        assert (root / path).exists(), path
    for model in ("base", "reward", "policy"):
        card = read_model_card(root / "models" / model)
        text = (root / "models" / model / "README.md").read_text()
        assert {"library_name", "tags"} <= set(card), model
        # a local tiny source with no card: no hub base model or licence is invented, the lineage says where from
        assert "base_model" not in card and "license" not in card, model
        assert ".tmp-" not in text and f"rlhf lineage models/{model}" in text or model == "base", model
    reward = read_model_card(root / "models/reward")  # last pooling: a stock sequence classifier
    assert reward["pipeline_tag"] == "text-classification" and (root / "models/reward/config.json").is_file()
    policy = read_model_card(root / "models/policy")
    assert policy["pipeline_tag"] == "text-generation" and policy["lineage"]["base_model_dir"] == "models/base"
    # what was learnt from and what to beware of; held-out results as the Hub's model-index where the
    # stage measured them (the policy's held-out evaluation comes later: its card points there)
    for model in ("reward_unnormalized", "reward", "policy"):
        text = (root / "models" / model / "README.md").read_text()
        assert "## Training data" in text and "## Limitations" in text, model
    accuracy = json.loads((root / "metrics/reward_train.json").read_text())["test/accuracy"]
    (result,) = read_model_card(root / "models/reward_unnormalized")["model-index"][0]["results"]
    assert result["metrics"][0]["type"] == "accuracy" and result["metrics"][0]["value"] == round(accuracy, 4)
    assert result["dataset"]["split"] == "test" and "held-out preference labels" in result["dataset"]["name"]
    assert "model-index" not in policy and "evaluation/report.md" in (root / "models/policy/README.md").read_text()
    generation = json.loads((root / "models/policy/generation_config.json").read_text())
    sampling = TINY_PARAMS["task"]
    assert generation["do_sample"] is True and generation["max_new_tokens"] == sampling["response_length"]
    assert generation["temperature"] == parse_params(TINY_PARAMS).task.temperature and generation["top_k"] == 0
    assert json.loads((root / "models/policy/tokenizer_config.json").read_text())["padding_side"] == "left"
    for model in ("base", "reward_unnormalized", "reward", "policy"):  # how this machine loaded it: not saved
        config = json.loads((root / "models" / model / "tokenizer_config.json").read_text())
        assert not {"local_files_only", "is_local"} & set(config), model


def test_long_stages_print_progress_and_no_hugging_face_bars(project):
    _, result = project
    log = result.stdout + result.stderr
    progress = [line for line in log.splitlines() if "/" in line and line.endswith(" s)")]
    for start in (
        "corpus: 200/200 passages",
        "preferences train: 64/64 rows labelled",
        "normalize_reward fit: ",
        "evaluate base: ",
        "evaluate policy: ",
    ):
        assert any(line.startswith(start) for line in progress), (start, progress)
    bars = [line for line in log.splitlines() if "it/s]" in line or "Loading" in line or "Saving the dataset" in line]
    assert bars == [], bars[:5]


def test_metrics_are_declared_and_sane(project):
    root, _ = project
    shown = json.loads(sh(["dvc", "metrics", "show", "--json"], root).stdout)
    metrics = {}
    for files in shown.values():
        for content in files.get("data", {}).values():
            metrics.update(content.get("data", {}))
    assert 0.0 <= metrics["test/accuracy"] <= 1.0
    assert 0.0 <= metrics["labels/ceiling_accuracy"] <= 1.0
    assert abs(metrics["normalized/mean"]) < 1.0 and metrics["normalized/mean_stderr"] > 0.0
    for key in (
        "gold/base_mean",
        "gold/policy_mean",
        "proxy/base_mean",
        "proxy/policy_mean",
        "kl/mean",
        "kl/stderr",
        "kl/exact_mean",
        "kl/exact_stderr",
        "win_rate/gold",
        "win_rate/proxy",
    ):
        assert key in metrics, key
    assert metrics["kl/exact_mean"] >= 0.0 and metrics["kl/exact_stderr"] >= 0.0  # exact: never negative
    points = json.loads((root / "evaluation/overoptimization.json").read_text())
    assert [p["update"] for p in points] == [0, 2, 4]
    # base and shipped policy on every query, the checkpoint between them on evaluate.curve_queries
    assert [p["queries"] for p in points] == [16, 8, 16]
    # strict JSON (no NaN/Infinity) in every metrics file: other tools' parsers refuse those
    for path in sorted((root / "metrics").glob("*.json")):
        json.loads(path.read_text(), parse_constant=lambda name, path=path: pytest.fail(f"{name} in {path.name}"))
    # compute.device: cpu, written out: every stage that samples, scores or trains records it
    for name in ("preferences", "reward_train", "reward", "policy", "evaluate"):
        assert json.loads((root / f"metrics/{name}.json").read_text())["device"] == "cpu (fp32)", name
    # the tiny run's gold labeller scores most of its gibberish alike: the correlation is a number in
    # [-1, 1], or null with the reason (which of the two depends on the tokens sampled, so on the CPU)
    reward = json.loads((root / "metrics/reward.json").read_text())
    if reward["gold_correlation"] is None:
        assert "distinct score" in reward["gold_correlation_undefined"]
    else:
        assert -1.0 <= reward["gold_correlation"] <= 1.0


def test_second_repro_is_a_no_op(project):
    root, _ = project
    result = sh(["dvc", "repro"], root)
    assert "Running stage" not in result.stdout
    assert "up to date" in result.stdout.lower()


OBJECTIVE = "PPO objective (score, KL, KL coefficient)"
CURVE = "Reward over-optimisation (Gao et al. 2022), improvement over the base ± paired SE"


def test_plots_show_the_ppo_objective_and_the_overoptimisation_curve(project):
    """What `dvc plots show` draws (its JSON): the PPO objective as one titled panel per series
    (score, KL, KL coefficient; each its own y scale), the over-optimisation curve as gold and proxy
    improvements in base-σ units against sqrt(KL) with ± SE bars, axes titled; every chart titled
    in words, none by a file path; no second, index-based plot of the curve's data."""
    root, _ = project
    plots = json.loads(sh(["dvc", "plots", "show", "--json"], root).stdout)["data"]
    assert not [name for name in plots if "/" in name and name != "evaluation/samples.json"], list(plots)
    objective = plots[OBJECTIVE][0]["content"]
    # the template's `series` is the file name without .tsv: one panel per file
    series = {(row["filename"], row["field"]) for row in objective["data"]["values"]}
    assert series == {("score.tsv", "score"), ("kl.tsv", "kl"), ("kl_coef.tsv", "kl_coef")}
    assert objective["transform"][0]["as"] == "series"
    assert len(objective["data"]["values"]) == 3 * (
        TINY_PARAMS["ppo"]["total_episodes"] // TINY_PARAMS["ppo"]["batch_size"]
    )
    assert objective["facet"]["row"]["field"] == "series" and objective["resolve"]["scale"]["y"] == "independent"
    assert objective["spec"]["encoding"]["x"]["title"] == "PPO update" and objective["title"] == OBJECTIVE
    curve = plots[CURVE][0]["content"]
    assert curve["encoding"]["x"]["field"] == "sqrt_kl" and "KL" in curve["encoding"]["x"]["title"]
    line, bars, _labels = curve["layer"]
    assert line["encoding"]["y"]["title"] == "improvement over the base  [base σ]"
    assert bars["mark"]["type"] == "errorbar"
    fields = {row["field"] for row in curve["data"]["values"]}
    assert fields <= {"gold_std_units", "proxy_std_units"} and "proxy_std_units" in fields
    assert all("proxy_stderr" in row for row in curve["data"]["values"])
    assert "evaluation/overoptimization.json" not in plots


@pytest.mark.parametrize("command", [["show"], ["diff", "HEAD~1"]], ids=["show", "diff"])
def test_plots_pages_draw_every_chart_offline_in_a_real_browser(project, chromium, tmp_path, command):
    """`dvc plots show` / `dvc plots diff` pages, opened in headless Chromium with every host name
    unresolvable: each plot has its canvas or SVG, the page requested nothing but itself, no script failed."""
    root, _ = project
    sh(["dvc", "plots", *command, "-o", str(tmp_path / "page")], root)
    with HeadlessChromium(chromium) as browser:
        report = browser.load(page_url(tmp_path / "page" / "index.html"), DVC_PLOTS, DVC_PLOTS_DRAWN, timeout_s=60)
    charts = dict(report.result["charts"])
    assert any(name.startswith("PPO_objective") for name in charts), charts
    assert len(charts) >= 8, charts
    assert [name for name, drawn in charts.items() if not drawn] == []
    assert report.failed == [] and report.errors == []
    assert [url for url in report.requested if not url.startswith("file://")] == []


def test_lineage_of_the_policy_reaches_the_sources(project):
    root, _ = project
    result = sh([sys.executable, "-m", "rlhf_pipeline.cli", "lineage", "models/policy", "--json"], root)
    event = json.loads(result.stdout)
    assert event["job"]["name"] == "train_policy"
    names = {item["name"] for item in event["inputs"]}
    assert {"models/base", "data/preferences", "models/reward"} <= names
    # the card's record of the CPU numerics the stage pinned, which `rlhf lineage` shows
    pinned = event["run"]["facets"]["environment"]["recorded"]["cpu_numerics"]
    assert pinned["mode"] == "portable" and pinned["threads"] == 1 and pinned["level"] == "AVX2"
    # and the device the card records (compute.device, resolved)
    assert event["run"]["facets"]["environment"]["device"] == "cpu (fp32)"


def test_changing_a_normalisation_param_reruns_only_downstream(project, tmp_path):
    # A real repro on a copy: `dvc repro --dry` cannot know that downstream inputs will change.
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["reward"]["normalize"]["target_std"] = 2.0
    (clone / "params.yaml").write_text(yaml.safe_dump(params))
    result = sh(["dvc", "repro"], clone)
    # train_reward's normalize_before pass fits to the same target, so it reruns too
    assert ran_stages(result) == {"train_reward", "normalize_reward", "train_policy", "evaluate"}


def test_two_responses_per_query_rerun_only_evaluate_and_repeat_each_query(project, tmp_path):
    """evaluate.responses_per_query: 2 on a copy of the tiny run: only evaluate reruns; every held-out query
    has two rows in a row, two draws; errors and counts are over the 16 queries; the curve's checkpoint is
    on whole batches of queries: 3 wanted, one batch of 4 queries x 2 responses (batch_size 8 counts responses)."""
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["evaluate"]["responses_per_query"] = 2
    params["evaluate"]["curve_queries"] = 3
    (clone / "params.yaml").write_text(yaml.safe_dump(params))
    assert ran_stages(sh(["dvc", "repro"], clone)) == {"evaluate"}
    metrics = json.loads((clone / "metrics/evaluate.json").read_text())
    assert metrics["responses_per_query"] == 2 and metrics["queries"] == 16 and metrics["gold/queries"] == 16
    rows = [json.loads(line) for line in (clone / "evaluation/responses.jsonl").read_text().splitlines()]
    firsts, seconds = rows[0::2], rows[1::2]
    assert len(rows) == 32 and [r["query"] for r in firsts] == [r["query"] for r in seconds]
    assert any(a["policy_response"] != b["policy_response"] for a, b in zip(firsts, seconds))
    points = json.loads((clone / "evaluation/overoptimization.json").read_text())
    assert [p["queries"] for p in points] == [16, 4, 16]
    assert "16, 2 response(s) to each" in (clone / "evaluation/report.md").read_text()


# Declared keys that the tiny run (simulated labels) does not reach, and the path that reads them.
READ_ON_OTHER_PATHS = {
    ("preferences", "data.queries.test_fraction"): "user labels without a split column",
    ("preferences", "data.validation.max_text_chars"): "user labels: over-long texts are refused before tokenization",
    ("queries", "data.preferences.source"): "task.chat without data.queries.prompts: the preference data's prompts",
}


def test_each_stage_read_every_param_it_declares(project):
    """The runner lets a stage read declared keys only (an undeclared read fails the repro above);
    this checks the other direction: nothing is declared that the stage never reads."""
    root, _ = project
    reads_dir = root.parent / f"{root.name}-reads"
    for stage in pipeline_stages(root):
        reads = set(json.loads((reads_dir / f"{stage.name}.json").read_text()))
        reads |= {key for (name, key) in READ_ON_OTHER_PATHS if name == stage.name}
        declared = declared_param_keys(stage.name, root)
        unread = {key for key in declared if not any(r == key or r.startswith(key + ".") for r in reads)}
        assert not unread, f"stage {stage.name} declares {sorted(unread)} in dvc.yaml but never read them"
        assert all(any(r == key or r.startswith(key + ".") for key in declared) for r in reads)


@pytest.mark.parametrize(
    "module, importers",
    [
        ("rlhf_pipeline/reward/model.py", {"train_reward", "normalize_reward", "train_policy", "evaluate"}),
    ],
)
def test_editing_a_module_reruns_exactly_the_stages_that_import_it(project, tmp_path, module, importers):
    root, _ = project
    assert stage_importers(module) == importers  # what the import analysis derives
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    with open(clone / module, "a") as handle:
        handle.write("\n# an edit that changes no behaviour\n")
    assert ran_stages(sh(["dvc", "repro"], clone)) == importers
    assert "Running stage" not in sh(["dvc", "repro"], clone).stdout


def test_bad_preference_data_stops_the_pipeline_and_touches_nothing(project, tmp_path):
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    reward_before = (clone / "models/reward/reward_head.safetensors").read_bytes()
    bad = [{"prompt": "Tell me.", "chosen": "Same answer.", "rejected": "Same answer."} for _ in range(40)]
    (clone / "data/labels/bad.jsonl").write_text("\n".join(json.dumps(r) for r in bad) + "\n")
    params = yaml.safe_load((clone / "params.yaml").read_text())
    params["data"]["preferences"]["source"] = "data/labels/bad.jsonl"
    (clone / "params.yaml").write_text(yaml.safe_dump(params))
    result = sh(["dvc", "repro"], clone, check=False)
    assert result.returncode != 0
    assert "Running stage 'validate_preferences'" in result.stdout
    assert "Running stage 'train_reward'" not in result.stdout
    assert (clone / "models/reward/reward_head.safetensors").read_bytes() == reward_before
    summary = json.loads((clone / "data/validation/summary.json").read_text())
    assert summary["success"] is False


# Two threads of matrix products: it competes with the stage for both cores and for the same
# OpenMP/MKL machinery, the worst case for a thread-count-dependent result.
COMPETITOR = (
    "import torch\ntorch.set_num_threads(2)\na = torch.randn(768, 768)\nwhile True:\n    a = torch.tanh(a @ a)\n"
)


def file_digests(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def locked_outs(root: Path) -> dict[str, str]:
    """``{output path: md5}`` of every output dvc.lock records, the metrics files included (timings
    live in metrics/speed.json, which no stage declares)."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


def test_a_forced_rerun_records_the_same_hashes(project, tmp_path):
    """Every stage rerun (`dvc repro --force`, the checkpoints removed so PPO trains from update 0):
    dvc.lock is the same bytes, metrics files included, so the lock shows the run was reproduced. No
    card, validation result, log, metric or checkpoint holds a time, a commit or a machine path (the
    one timing, episodes per second, is in metrics/speed.json, which no stage declares)."""
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    shutil.rmtree(clone / "checkpoints" / "policy")  # else train_policy resumes from its final checkpoint
    assert ran_stages(sh(["dvc", "repro", "--force"], clone)) == ALL_STAGES
    first, second = locked_outs(root), locked_outs(clone)
    assert set(first) == set(second) and len(first) >= 12
    assert {path: md5 for path, md5 in second.items() if first[path] != md5} == {}
    assert (clone / "dvc.lock").read_bytes() == (root / "dvc.lock").read_bytes()  # byte for byte
    assert json.loads((clone / "metrics/speed.json").read_text())["episodes_per_second"] > 0


def test_outputs_are_byte_identical_beside_a_competing_process(project, tmp_path):
    """corpus (sampling) and train_policy (sampling and training), rerun while another CPU-bound
    torch process runs, write the same bytes as the first run, which ran alone."""
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    shutil.rmtree(clone / "checkpoints" / "policy")  # else train_policy resumes from its final checkpoint
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR])
    try:
        for stage in ("corpus", "train_policy"):
            sh(["dvc", "repro", "--force", "--single-item", stage], clone)
        assert competitor.poll() is None, "the competing process stopped early"
    finally:
        competitor.kill()
    assert file_digests(clone / "data" / "corpus") == file_digests(root / "data" / "corpus")
    for output in ("models/policy", "checkpoints/policy", "dvclive/train_policy"):  # cards and logs included
        assert file_digests(clone / output) == file_digests(root / output), output


def test_a_commit_leaves_the_stages_after_a_rerun_stage_up_to_date(project, tmp_path):
    """Nothing a stage writes depends on git: a new commit, then train_reward forced to run again,
    leaves normalize_reward, train_policy and evaluate up to date (their inputs are the same bytes)."""
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    (clone / "NOTES.md").write_text("a commit that changes nothing the pipeline reads\n")
    sh(["git", "add", "NOTES.md"], clone)
    sh(["git", "commit", "-qm", "notes"], clone)
    assert ran_stages(sh(["dvc", "repro", "--force", "--single-item", "train_reward"], clone)) == {"train_reward"}
    assert json.loads(sh(["dvc", "status", "--json"], clone).stdout) == {}


def edit_file(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


# (file, text, replacement, the stages it may stale): a body edit or a new schema field
NARROW_EDITS = {
    "gae": (
        "rlhf_pipeline/ppo/advantages.py",
        "    length = rewards.size(-1)\n",
        "    length = int(rewards.size(-1))\n",
    ),
    "ppo loss": ("rlhf_pipeline/ppo/losses.py", "    ratio = torch.exp(log_ratio)\n", "    ratio = log_ratio.exp()\n"),
    "ppo field": (
        "rlhf_pipeline/params/ppo.py",
        '    @model_validator(mode="after")\n    def _batches_fit(',
        '    new_knob: int = 0\n\n    @model_validator(mode="after")\n    def _batches_fit(',
    ),
    "reward loss": (  # the reward model's training: its only reader is train_reward
        "rlhf_pipeline/reward/training.py",
        "    loss = F.cross_entropy(logits, best)\n",
        '    loss = F.cross_entropy(logits, best, reduction="mean")\n',
    ),
    "contract": ("rlhf_pipeline/contract.py", "EXAMPLES = 3\n", "EXAMPLES = 3  # rows shown per failed check\n"),
}
AFTER_REWARD = {"train_reward", "normalize_reward", "train_policy", "evaluate"}
MAY_STALE = {
    "gae": {"train_policy", "evaluate"},
    "ppo loss": {"train_policy", "evaluate"},
    # base_model checks ppo.freeze_layers and ppo.lora against the model it builds; its rerun repeats its bytes
    "ppo field": {"base_model", "train_policy", "evaluate"},
    "reward loss": {"train_reward"},
    "contract": {"validate_preferences"} | AFTER_REWARD,
}


def test_an_edit_stales_only_the_stages_that_use_it(project, tmp_path):
    """In a copy of the finished run, each edit makes `dvc status` list only the stages whose code
    it is: the layering of the library (maths and I/O at the bottom, each stage's code on top)."""
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    for name, (file, old, new) in NARROW_EDITS.items():
        edit_file(clone / file, old, new)
        stale = set(json.loads(sh(["dvc", "status", "--json"], clone).stdout))
        assert stale and stale <= MAY_STALE[name], (name, sorted(stale))
        sh(["git", "checkout", "--", file], clone)
    assert json.loads(sh(["dvc", "status", "--json"], clone).stdout) == {}


def test_the_local_base_model_s_bytes_are_an_input(project, tmp_path):
    """base_model.source is a folder in data/models/, which dvc.yaml declares: halving its weights in
    place stales base_model, and its rerun records the new folder's hash in the card."""
    from safetensors.torch import load_file, save_file

    from rlhf_pipeline.io import content_hash

    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    weights = clone / TINY_SOURCE / "model.safetensors"
    save_file({name: tensor * 0.5 for name, tensor in load_file(weights).items()}, weights)
    # data/models is a dependency of both stages that may read a local model (reward.pretrained too)
    assert set(json.loads(sh(["dvc", "status", "--json"], clone).stdout)) == {"base_model", "train_reward"}
    assert ran_stages(sh(["dvc", "repro", "--single-item", "base_model"], clone)) == {"base_model"}
    assert read_model_card(clone / "models/base")["source_sha256"] == content_hash(clone / TINY_SOURCE)
    assert "base_model" not in json.loads(sh(["dvc", "status", "--json"], clone).stdout)


def flip_a_byte(path: Path, offset: int = -100) -> None:
    """Change one byte in place, keeping the size and modification time (what DVC's state db sees)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def cache_object(root: Path, md5: str) -> Path:
    return root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def test_damaged_bytes_are_found_and_never_trained_on(project, tmp_path):
    """A flipped byte (size and mtime kept) in a workspace file, in a DVC cache object and in a
    checkpoint snapshot, and a file planted in a model folder: DVC's status still says up to date,
    `rlhf lineage --verify` names each one (exit 7), and the stages that would read them refuse
    (exit 7) without recording anything."""
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    rlhf = [sys.executable, "-m", "rlhf_pipeline.cli"]
    lock_before = (clone / "dvc.lock").read_text()
    assert "ok: " in sh([*rlhf, "lineage", "--verify", "."], clone).stdout
    assert json.loads(sh(["dvc", "status", "--json"], clone).stdout) == {}  # DVC's state db now knows the copy

    weights = clone / "models/base/model.safetensors"
    original = weights.read_bytes()
    flip_a_byte(weights)
    assert json.loads(sh(["dvc", "status", "--json"], clone).stdout) == {}  # what DVC's state db misses
    checked = sh([*rlhf, "lineage", "--verify", "models/base"], clone, check=False)
    assert checked.returncode == 7, checked.stdout + checked.stderr
    assert "models/base/model.safetensors: the workspace copy has md5" in checked.stderr
    refused = sh(["dvc", "repro", "--force", "--single-item", "corpus"], clone, check=False)
    assert refused.returncode != 0 and "exited with 7" in refused.stdout + refused.stderr
    assert "models/base is damaged: model.safetensors does not match" in refused.stdout + refused.stderr
    weights.write_bytes(original)

    md5 = {
        entry["relpath"]: entry["md5"]
        for entry in json.loads(cache_object(clone, locked_outs(clone)["models/policy"]).read_text())
    }
    flip_a_byte(cache_object(clone, md5["model.safetensors"]))
    checked = sh([*rlhf, "lineage", "--verify", "models/policy/model.safetensors"], clone, check=False)
    assert checked.returncode == 7 and "the DVC cache object" in checked.stderr and "is damaged" in checked.stderr

    # a LoRA adapter planted beside the policy's weights: transformers would apply it on load
    planted = [clone / "models/policy/adapter_config.json", clone / "models/policy/adapter_model.safetensors"]
    planted[0].write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    planted[1].write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    refused = sh(["dvc", "repro", "--force", "--single-item", "evaluate"], clone, check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "exited with 7" in output, output
    assert "models/policy is damaged: adapter_config.json is not listed" in output
    assert "Traceback" not in output
    for path in planted:
        path.unlink()

    flip_a_byte(clone / "checkpoints/policy/snapshots/update_00002.safetensors")
    refused = sh(["dvc", "repro", "--force", "--single-item", "evaluate"], clone, check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "exited with 7" in output
    assert "snapshots/update_00002.safetensors does not match its recorded sha256" in output
    assert (clone / "dvc.lock").read_text() == lock_before  # nothing was recorded as good


def test_a_non_editable_install_trains_the_policy(project, tmp_path):
    """`pip install .` (a wheel in a scratch environment's site-packages, reusing this environment's
    dependencies) runs train_policy of the tiny pipeline from the project's checkout and writes the
    same bytes as the editable install: nothing a stage reads (its code hash included) is looked up
    beside the installed package as if it were the checkout."""
    root, _ = project
    source = tmp_path / "source"  # a copy to build from: pip builds in-tree, and the checkout stays clean
    source.mkdir()
    for item in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / item).exists():
            shutil.copy(REPO / item, source / item)
    shutil.copytree(REPO / "rlhf_pipeline", source / "rlhf_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    site = next((venv / "lib").glob("python*/site-packages"))
    dependencies = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    # a path in a .pth file is added without reading the .pth files inside it, so the editable
    # install's finder there stays out: rlhf_pipeline comes from the wheel
    (site / "dependencies.pth").write_text(f"{dependencies}\n")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    sh([*pip, "--target", str(site), str(source)], tmp_path)

    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    shutil.rmtree(clone / "checkpoints" / "policy")  # else train_policy resumes from its final checkpoint
    path = f"{venv / 'bin'}:{BIN}:{os.environ['PATH']}"  # `python` is the scratch one, `dvc` this one's
    scratch = {"PATH": path, "PYTHONPATH": ""}  # nothing of the checkout on the path, as for a user
    where = "import rlhf_pipeline, sys; print(rlhf_pipeline.__file__, sys.prefix)"
    found = sh(["python", "-c", where], clone / "stages", **scratch).stdout.split()  # the stages' sys.path[0]
    assert found == [str(site / "rlhf_pipeline" / "__init__.py"), str(venv)]
    result = sh(["dvc", "repro", "--force", "--single-item", "train_policy"], clone, **scratch)
    assert ran_stages(result) == {"train_policy"}
    for output in ("models/policy", "checkpoints/policy", "dvclive/train_policy"):
        assert file_digests(clone / output) == file_digests(root / output), output
    assert sh(["dvc", "status", "train_policy"], clone, **scratch).stdout.strip() in (
        "",
        "Data and pipelines are up to date.",
    )


def test_a_user_label_file_is_read_only_where_dvc_tracks_it(project, tmp_path):
    """data.preferences.source outside data/labels/ (which dvc.yaml declares for the stages that read
    it) is refused, exit 2, nothing recorded; inside it, editing the file stales preferences (and
    queries, which reads the same folder) in `dvc status`."""
    root, _ = project
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    rows = [
        {"prompt": f"Prompt {i}.", "chosen": f"A good answer {i}.", "rejected": f"A bad one {i}."} for i in range(12)
    ]
    outside = tmp_path / "pairs.jsonl"
    outside.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lock_before = (clone / "dvc.lock").read_text()

    def use(source: str) -> None:
        params = yaml.safe_load((clone / "params.yaml").read_text())
        params["data"]["preferences"]["source"] = source
        (clone / "params.yaml").write_text(yaml.safe_dump(params))

    use(str(outside))
    refused = sh(["dvc", "repro", "--single-item", "preferences"], clone, check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "exited with 2" in output, output
    assert "data.preferences.source: the file" in output and "Copy it into data/labels/" in output
    assert (clone / "dvc.lock").read_text() == lock_before
    shutil.copy(outside, clone / "data/labels/pairs.jsonl")
    use("data/labels/pairs.jsonl")
    sh(["dvc", "repro", "--single-item", "preferences"], clone)
    assert "preferences" not in json.loads(sh(["dvc", "status", "--json"], clone).stdout)
    (clone / "data/labels/pairs.jsonl").write_text(outside.read_text().replace("A good answer 3.", "Better: 3."))
    stale = json.loads(sh(["dvc", "status", "--json"], clone).stdout)
    for stage in ("preferences", "queries"):
        changed = [entry.get("changed deps", {}) for entry in stale[stage] if isinstance(entry, dict)]
        assert any(deps.get("data/labels") == "modified" for deps in changed), stale
