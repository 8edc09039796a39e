"""params.yaml schema and the `rlhf check-params` command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_pipeline.errors import ParamsError
from rlhf_pipeline.params.ppo import KLParams, PPOParams
from rlhf_pipeline.params.schema import Params, load_params, parse_params

REPO = Path(__file__).resolve().parents[1]
SHIPPED = yaml.safe_load((REPO / "params.yaml").read_text())


def test_shipped_params_validate():
    params = load_params(REPO / "params.yaml")
    assert params.task.truncate_token is None or params.task.response_length > params.task.truncate_after


def test_truncate_after_is_not_checked_without_a_truncate_token():
    params = parse_params(broken("task.truncate_after", 40, task__truncate_token=None))
    assert params.task.truncate_after == 40


def test_schema_defaults_are_the_reference_values():
    p = Params()
    assert (p.data.queries.query_length, p.task.response_length, p.task.temperature) == (64, 24, 0.7)
    assert (p.reward.train.lr, p.reward.train.epochs, p.ppo.lr, p.ppo.ppo_epochs) == (5e-5, 1, 1e-5, 4)
    assert (p.ppo.gamma, p.ppo.lam, p.ppo.cliprange, p.ppo.cliprange_value, p.ppo.vf_coef) == (1.0, 0.95, 0.2, 0.2, 0.1)
    assert (p.ppo.kl.init_coef, p.ppo.kl.target, p.ppo.kl.horizon) == (0.15, 6.0, 10000)
    assert (p.task.truncate_token, p.task.truncate_after, p.task.penalty_reward) == (".", 16, -1.0)
    assert p.reward.normalize.normalize_samples == 256
    assert p.ppo.whiten_rewards and p.ppo.value_model == "shared"
    assert p.reward.train.pooling == "last" and p.reward.train.batch_size == 32


# PPO and KL fields whose default is a value of the reference run: each description says "reference"
# and links the line it follows, pinned to a commit of OpenAI's code or lm-human-preference-details.
REFERENCE_PPO_FIELDS = {
    "total_episodes", "batch_size", "nminibatches", "microbatch_size", "ppo_epochs", "lr", "anneal_lr", "adam_eps",
    "tensorflow_adam", "max_grad_norm", "gamma", "lam", "cliprange", "cliprange_value", "vf_coef", "entropy_coef",
    "whiten_rewards", "advantage", "value_model", "dropout",
}  # fmt: skip
# KL fields outside the reference (its default is the reference's behaviour: no budget)
NON_REFERENCE_KL_FIELDS = {"budget", "budget_window", "budget_check_responses", "budget_backtracks", "budget_search"}
PINNED_LINK = re.compile(
    r"https://github\.com/(openai/lm-human-preferences|vwxyzjn/lm-human-preference-details)/blob/[0-9a-f]{40}/\S+#L\d+"
)


@pytest.mark.parametrize("schema", [PPOParams, KLParams])
def test_every_ppo_and_kl_field_is_described_and_reference_values_link_their_line(schema):
    fields = schema.model_fields
    assert [name for name, field in fields.items() if not field.description] == []
    cited = REFERENCE_PPO_FIELDS if schema is PPOParams else set(fields) - NON_REFERENCE_KL_FIELDS
    assert cited <= set(fields)
    missing = [
        name
        for name in sorted(cited)
        if "reference" not in fields[name].description.lower() or not PINNED_LINK.search(fields[name].description)
    ]
    assert missing == []


def broken(path: str, value, **also):
    """The shipped params with `path` set to `value` (and each `also` key, dots as "__")."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for dotted, setting in [(path, value), *((k.replace("__", "."), v) for k, v in also.items())]:
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = setting
    return raw


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("ppo.lr", -1.0, "ppo.lr: Input should be greater than 0"),
        ("ppo.lr", "fast", "ppo.lr: Input should be a valid number"),
        ("ppo.nminibatches", 3, "ppo.nminibatches: must divide ppo.batch_size"),
        ("ppo.microbatch_size", 5, "ppo.microbatch_size: must divide the minibatch size"),
        ("task.truncate_after", 40, "task.truncate_after: must be < task.response_length"),
        ("reward.train.microbatch_size", 5, "reward.train.microbatch_size: must divide reward.train.batch_size"),
        ("ppo.kl.estimator", "k2", "ppo.kl.estimator: Input should be 'k1' or 'k3'"),
        ("reward.train.pooling", "max", "reward.train.pooling: Input should be 'last' or 'mean'"),
        ("ppo.total_episodes", 4, "ppo.total_episodes: must be >= ppo.batch_size"),
        ("data.queries.test_fraction", 1.5, "data.queries.test_fraction: Input should be less than 1"),
        ("schedule.timezone", "Mars/Olympus", "schedule.timezone: Value error, not an IANA time zone name"),
        ("schedule.cron", "61 3 * * 1", "schedule.cron: Value error, not a 5-field cron expression"),
        ("schedule.cron", "every monday", "schedule.cron: Value error, not a 5-field cron expression"),
        ("schedule.cron", "H 3 * * 1", "schedule.cron: Value error, not a 5-field cron expression"),
        ("ppo.lr", float("inf"), "ppo.lr: Input should be a finite number"),
        ("reward.normalize.target_mean", float("nan"), "reward.normalize.target_mean: Input should be a finite number"),
        ("seed", 2**32, "seed: Input should be less than or equal to 4294967295"),
        ("ppo.advantage", "rloo", "ppo.samples_per_query: must be >= 2 for ppo.advantage 'rloo'"),
        ("ppo.advantage", "ppo2", "ppo.advantage: Input should be 'gae', 'rloo' or 'grpo'"),
        ("ppo.samples_per_query", 3, "ppo.samples_per_query: must divide ppo.batch_size (32)"),
        (
            "ppo.rollout_microbatch_size",
            12,
            "ppo.rollout_microbatch_size: must be a multiple of ppo.samples_per_query (1",
        ),
        ("ppo.rollout_microbatch_size", 0, "ppo.rollout_microbatch_size: Input should be greater than 0"),
        ("ppo.lora", {"rank": 0}, "ppo.lora.rank: Input should be greater than 0"),
        ("ppo.lora", {"rank": 4, "target_modules": "all"}, "ppo.lora.target_modules"),
        # an empty list adapts nothing (peft's NoMatchingPeftModuleError at the stage, retried by the flow)
        (
            "ppo.lora",
            {"rank": 4, "target_modules": []},
            "ppo.lora.target_modules.list[constrained-str]: List should have at least 1",
        ),
        ("ppo.lora", {"rank": 4, "target_modules": [""]}, "ppo.lora.target_modules.list[constrained-str].0"),
        ("labelling.max_export_mb", 0, "labelling.max_export_mb: Input should be greater than 0"),
        ("labelling.server_timeout_s", float("inf"), "labelling.server_timeout_s: Input should be a finite number"),
        # strict types: a boolean is not a number, a string not a length
        ("ppo.lr", True, "ppo.lr: Input should be a valid number"),
        ("seed", True, "seed: Input should be a valid integer"),
        ("data.queries.query_length", "24", "data.queries.query_length: Input should be a valid integer"),
        # sizes and counts a typo could blow up
        (
            "data.queries.query_length",
            1_000_000_000,
            "data.queries.query_length: Input should be less than or equal to 131072",
        ),
        ("ppo.total_episodes", 1e30, "ppo.total_episodes: Input should be a valid integer"),
        ("ppo.total_episodes", 10**12, "ppo.total_episodes: Input should be less than or equal to 100000000"),
        (
            "data.corpus.num_passages",
            10**12,
            "data.corpus.num_passages: Input should be less than or equal to 100000000",
        ),
        # crons that never fire, or have a sixth field
        ("schedule.cron", "0 3 30 2 *", "schedule.cron: Value error, does not fire within the next year"),
        ("schedule.cron", "0 3 * * 1 2026", "schedule.cron: Value error, not a 5-field cron expression"),
        # people's labels: the stages must train on the file the flow brings them into
        (
            "labelling.source",
            "file",
            "data.preferences.source: must be the .jsonl or .parquet file in this project that a run brings labels "
            "into when labelling.source is file",
        ),
        # the labels file had a second key once: an old params file is told where it went
        (
            "labelling.labels_file",
            "data/labels/human.jsonl",
            "labelling.labels_file: this key moved to data.preferences.source (one key names the labels file",
        ),
        ("labelling", {"source": "label_studio", "label_studio_project": 2}, "data.preferences.source: must be"),
        (
            "labelling",
            {"source": "label_studio"},
            "labelling.label_studio_project: must name the project to pull when source is label_studio",
        ),
        ("labelling.source", "labelstudio", "labelling.source: Input should be 'simulated', 'file' or 'label_studio'"),
        # a frozen judge is a labeler or a model folder; the golden set no round may write to
        (
            "promotion.judge",
            "gpt-4",
            "promotion.judge: must be one of ['vader'], null, a reward model folder in data/models/, or a version",
        ),
    ],
)
def test_each_rule_is_refused_with_its_key_path(path, value, expected):
    # truncate_after only matters (and is only checked) when a truncate token is set
    with pytest.raises(ParamsError) as info:
        parse_params(broken(path, value, task__truncate_token="."))
    assert any(line.startswith(expected) for line in info.value.problems), info.value.problems
    assert all("(got " in line for line in info.value.problems)


def test_a_frozen_judge_is_a_model_folder_and_its_golden_set_no_round_s_target():
    golden = "data/labels/golden.jsonl"
    judged = parse_params(broken("promotion", {"judge": "data/models/judge", "golden_labels": golden}))
    assert judged.promotion.frozen_judge == "data/models/judge"
    assert parse_params(broken("promotion.judge", "vader")).promotion.frozen_judge is None
    # a registered version, pinned; a stage moves, so it is no frozen judge
    assert parse_params(broken("promotion.judge", "reward-model@v1")).promotion.frozen_judge == "reward-model@v1"
    for moving in ("reward-model#prod", "reward-model@latest", "models/reward"):
        with pytest.raises(ParamsError, match="or a version NAME@vN"):
            parse_params(broken("promotion.judge", moving))
    with pytest.raises(ParamsError) as info:
        parse_params(
            broken("labelling.source", "file", data__preferences__source=golden, promotion__golden_labels=golden)
        )
    assert any(
        line.startswith("data.preferences.source: is promotion.golden_labels") for line in info.value.problems
    ), info.value.problems


def test_unknown_keys_are_refused():
    raw = broken("ppo.lr", 1e-5)
    raw["ppo"]["learning_rate"] = 1e-5
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    assert info.value.problems == [
        "ppo.learning_rate: unknown key (typo? see params.yaml and rlhf_pipeline/params/ppo.py) (got 1e-05)"
    ]


def test_several_problems_are_all_reported():
    raw = broken("ppo.lr", -1.0)
    raw["seed"] = -3
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    assert {line.split(":")[0] for line in info.value.problems} == {"seed", "ppo.lr"}


def run_cli(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "rlhf_pipeline.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_cli_accepts_the_shipped_file():
    result = run_cli("check-params")
    first, *notes = result.stdout.strip().splitlines()
    assert result.returncode == 0 and first == "ok" and all(note.startswith("note: ") for note in notes)


def test_cli_refuses_broken_file_with_exit_2_and_no_traceback(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(broken("ppo.cliprange", 0)))
    result = run_cli("check-params", str(bad))
    assert result.returncode == 2
    assert "ppo.cliprange: Input should be greater than 0 (got 0)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "content, message", [("a: [1, 2", "is not valid YAML"), ("- 1\n- 2\n", "<root>: must be a mapping")]
)
def test_cli_refuses_malformed_yaml(tmp_path, content, message):
    bad = tmp_path / "params.yaml"
    bad.write_text(content)
    result = run_cli("check-params", str(bad))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_cli_missing_file(tmp_path):
    result = run_cli("check-params", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "not found" in result.stderr


@pytest.mark.e2e
def test_stage_validates_params_with_the_same_messages(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(broken("base_model.dropout", 2.0)))
    result = subprocess.run(
        [sys.executable, str(REPO / "stages/base_model.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "base_model.dropout: Input should be less than 1 (got 2.0)" in result.stderr
    assert not (tmp_path / "models").exists()


def test_the_largest_32_bit_seed_is_accepted():
    assert parse_params(broken("seed", 2**32 - 1)).seed == 2**32 - 1


@pytest.mark.parametrize(
    "content, message",
    [
        ("seed: 1\nppo:\n  lr: 1.0e-5\n  lr: 2.0e-5\n", "key 'lr' is given twice in one mapping"),
        ("a: &a [1, 1]\nb: &b [*a, *a]\nc: &c [*b, *b]\n", "uses the alias *a; aliases are not allowed here"),
    ],
)
def test_yaml_dvc_would_refuse_or_that_would_hang_is_refused(tmp_path, content, message):
    bad = tmp_path / "params.yaml"
    bad.write_text(content)
    with pytest.raises(ParamsError) as info:
        load_params(bad)
    assert message in info.value.problems[0]


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """Nine levels of doubling would expand to 2**9 * 10 ... entries per level; refused before any expansion."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 10)
    ]
    bad = tmp_path / "params.yaml"
    bad.write_text("\n".join(lines) + "\n")
    result = run_cli("check-params", str(bad))
    assert result.returncode == 2 and "aliases are not allowed" in result.stderr


def test_a_file_that_is_not_utf8_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_bytes("seed: 1\nbase_model:\n  pad_token: caf\u00e9\n".encode("latin-1"))
    result = run_cli("check-params", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not UTF-8 text (byte 0xe9 on line 3)" in result.stderr


def test_cli_refuses_a_file_without_the_keys_dvc_yaml_tracks(tmp_path):
    """An empty params.yaml validates against the schema (every key has a default), but DVC reads
    tracked params from the file: `dvc repro` would fail after running the stage."""
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text("")
    result = run_cli("check-params", str(tmp_path / "params.yaml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    seed_line = next(
        line for line in result.stderr.splitlines() if line.startswith("seed: missing; dvc.yaml tracks it for ")
    )
    assert {"base_model", "corpus", "train_policy"} <= set(seed_line.split(" for ")[1].split(" (")[0].split(", "))
    assert "ppo.lr" not in result.stderr and "ppo: missing; dvc.yaml tracks it for train_policy" in result.stderr
    full = yaml.safe_load((REPO / "params.yaml").read_text())
    del full["reward"]["normalize"]["target_std"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(full))
    result = run_cli("check-params", str(tmp_path / "params.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[1:] == [
        "reward.normalize.target_std: missing; dvc.yaml tracks it for train_reward "
        "(DVC reads it from this file, not from the schema's default)"
    ]


def test_a_critic_free_estimator_refuses_a_value_model():
    with pytest.raises(ParamsError) as info:
        parse_params(broken("ppo.value_model", "separate", ppo__advantage="grpo", ppo__samples_per_query=4))
    assert info.value.problems == [
        "ppo.value_model: 'separate' builds a value model, which ppo.advantage 'grpo' has no use for; set it to "
        "'shared' (ignored) or use ppo.advantage 'gae' (got 'separate')"
    ]


def test_yaml_nested_too_deep_is_refused_with_exit_2(tmp_path):
    deep = tmp_path / "params.yaml"
    deep.write_text("seed: " + "[" * 20_000 + "]" * 20_000 + "\n")  # the YAML composer would recurse
    result = run_cli("check-params", str(deep))
    assert result.returncode == 2 and "nests values more than 16 levels deep" in result.stderr
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr
    deep.write_text("ppo: {lr: " + "[" * 40 + "]" * 40 + "}\n")
    assert "more than 16 levels deep" in run_cli("check-params", str(deep)).stderr


def test_check_params_outside_a_project_says_which_checks_it_could_not_run(tmp_path):
    (tmp_path / "params.yaml").write_text("")
    result = run_cli("check-params", str(tmp_path / "params.yaml"), cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [
        "ok",
        "note: the file sets nothing: every value is the schema's default",
        f"note: no dvc.yaml in {tmp_path}, so whether it spells out every key a stage tracks was not checked",
        "note: no models/base yet, so the values that depend on the model were not checked (base_model does)",
    ]


def test_a_context_longer_than_the_base_model_s_is_refused(tiny_base_dir):
    from rlhf_pipeline.models import require_context

    require_context(tiny_base_dir, 200, 56)  # the tiny Llama attends to 256 positions
    with pytest.raises(ParamsError, match=r"200 \+ 57 = 257 tokens, more than the 256 positions") as info:
        require_context(tiny_base_dir, 200, 57)
    assert info.value.exit_code == 2 and "max_position_embeddings" in str(info.value)


def test_a_base_model_folder_that_is_not_a_model_is_a_params_error(tmp_path, monkeypatch):
    from rlhf_pipeline.sources import load_source_model

    (tmp_path / "data/models/notes").mkdir(parents=True)
    (tmp_path / "data/models/notes/readme.txt").write_text("not a model\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParamsError, match="holds readme.txt, which is not a file of a transformers model") as info:
        load_source_model("data/models/notes")
    assert info.value.exit_code == 2 and "base_model.source: the model folder data/models/notes" in str(info.value)
