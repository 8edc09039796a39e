"""The `rlhf` command's own behaviour: version, the environment it leaves alone, the TRL export."""

from __future__ import annotations

from rlhf_pipeline.offline import OFFLINE_DEFAULTS

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, load_dataset

from rlhf_pipeline import __version__
from rlhf_pipeline.cli import main
from rlhf_pipeline.contract import validate_file_cli
from rlhf_pipeline.params import read_params_file
from rlhf_pipeline.params.schema import Params, load_params, parse_params
from rlhf_pipeline.runner import declared_keys_by_stage, missing_key_problems
from rlhf_pipeline.sources import load_source_model


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return exit_.value.code


def test_version(capsys):
    assert run_cli("--version") == 0
    assert capsys.readouterr().out.strip() == f"rlhf {__version__}"


def test_importing_the_library_changes_nothing_in_the_callers_environment():
    """The offline and quiet settings come from the entry points (rlhf_pipeline.offline), not from
    importing the package or any of its modules."""
    modules = (
        "rlhf_pipeline, rlhf_pipeline.params.schema, rlhf_pipeline.ppo.trainer, rlhf_pipeline.contract, "
        "rlhf_pipeline.lineage, rlhf_pipeline.runner, rlhf_pipeline.sources"
    )
    code = (
        "import json, os; before = dict(os.environ)\n"
        f"import {modules}\n"
        "after = dict(os.environ)\n"
        "print(json.dumps(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))))\n"
        "import rlhf_pipeline.offline\n"
        "print(json.dumps(sorted(k for k in os.environ if os.environ.get(k) != after.get(k))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_DEFAULTS and k != "PREFECT_HOME"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    by_import, by_entry_point = map(json.loads, out.splitlines())
    assert by_import == []
    assert set(OFFLINE_DEFAULTS) | {"PREFECT_HOME"} == set(by_entry_point)


def test_the_registry_and_verdict_commands_start_without_torch_or_transformers():
    """`rlhf models` (list, get, assign) and `rlhf label verdicts` read files, git and GTO; torch and
    transformers (about 3 s of CPU to import) load only when a command samples or scores a model."""
    code = (
        "import sys, json\n"
        "import rlhf_pipeline.cli, rlhf_pipeline.gate, rlhf_pipeline.fetching, rlhf_pipeline.registry_listing\n"
        "import rlhf_pipeline.side_by_side\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_an_rlhf_process_runs_its_command_with_the_collector_off_and_frozen_before_exit(tmp_path):
    """`rlhf` started from its command line: the command's imports (here torch, which `rlhf environment`
    loads to pin the numerics) and work set off no collection, and before the exit what the process
    holds is frozen, so the interpreter's last collection walks none of it. main() called with
    arguments (a test, a bench) leaves its caller's collector as it was."""
    probe = (
        "import atexit, gc, sys\n"
        "from rlhf_pipeline.cli import main\n"
        "walks = []\n"
        "gc.callbacks.append(lambda phase, info: walks.append(info['generation']) if phase == 'start' else None)\n"
        "atexit.register(lambda: print(len(walks), gc.isenabled(), gc.get_freeze_count(), 'torch' in sys.modules))\n"
        "sys.argv = ['rlhf', 'environment', '--root', sys.argv[1]]\n"
        "main()\n"
    )
    ran = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    collections, enabled, frozen, torch_loaded = ran.stdout.splitlines()[-1].split()
    assert (collections, enabled, torch_loaded) == ("0", "False", "True")
    assert int(frozen) > 50_000  # torch's modules, classes and functions, out of the last collection's reach

    frozen_before = gc.get_freeze_count()
    assert run_cli("environment", "--root", str(tmp_path)) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before


def test_export_preferences_writes_trls_pairwise_format(tmp_path, capsys):
    rows = [
        {"query": f"Query {i}.", "samples": [f"Sample {k} of {i}." for k in range(4)], "best": i % 4, "margin": 0.0}
        for i in range(24)
    ]
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:4])}).save_to_disk(
        tmp_path / "prefs"
    )
    target = tmp_path / "pairs.jsonl"
    assert run_cli("export-preferences", str(target), "--input", str(tmp_path / "prefs")) == 0
    assert "72 pairs" in capsys.readouterr().out
    pairs = load_dataset("json", data_files=str(target), split="train")  # how TRL users load it
    assert pairs.column_names == ["prompt", "chosen", "rejected"]  # no all-zero margin column
    assert len(pairs) == 24 * 3
    first = [p for p in pairs if p["prompt"] == "Query 5."]
    assert {p["chosen"] for p in first} == {"Sample 1 of 5."}
    assert sorted(p["rejected"] for p in first) == ["Sample 0 of 5.", "Sample 2 of 5.", "Sample 3 of 5."]
    # the export is itself a valid pairwise file for the data contract
    assert validate_file_cli(str(target), params_path=str(tmp_path / "none.yaml")) == 0
    assert run_cli("export-preferences", str(tmp_path / "pairs.csv"), "--input", str(tmp_path / "prefs")) == 1
    assert "write .jsonl or .parquet" in capsys.readouterr().err
    # an output under a file, or in /proc: one paragraph, the output's exit code, nothing written
    for bad in (target / "pairs.jsonl", Path("/proc/pairs.jsonl")):
        assert run_cli("export-preferences", str(bad), "--input", str(tmp_path / "prefs")) == 5
        err = capsys.readouterr().err
        assert err.startswith(f"rlhf export-preferences: error: could not write {bad}: ") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl", "prefs"]


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """`rlhf ... | head -1`: the reader is gone; no BrokenPipeError traceback, the shell's SIGPIPE status."""
    (tmp_path / "params.yaml").write_text("")
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `head` does once it has its line
    try:
        result = subprocess.run(
            [sys.executable, "-m", "rlhf_pipeline.cli", "check-params", str(tmp_path / "params.yaml")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141 and result.stderr == ""


def test_plots_page_refuses_a_folder_that_is_not_a_dvc_project(tmp_path, capsys):
    assert run_cli("plots-page", "--root", str(tmp_path / "none")) == 2
    assert f"--root {tmp_path / 'none'} is not a folder" in capsys.readouterr().err
    assert run_cli("plots-page", "--root", str(tmp_path)) == 2
    assert "is not in a DVC project: no .dvc folder in it or in any folder above it" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_commands_with_a_root_find_the_project_from_its_folders_and_refuse_a_root_outside_one(
    tmp_path, monkeypatch, capsys
):
    """`rlhf models`, `lineage`, `environment` and `plots-page` work on the project holding the working
    directory, found as `dvc` finds its own; they used to read the working directory itself, so from
    `data/`, or with a mistyped --root, `rlhf models` said "no registered versions yet" and `rlhf
    environment` "no requirements.lock (packages unlocked)": answers about the wrong folder."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    monkeypatch.chdir(project)
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], check=True)
    Path("dvc.yaml").write_text("artifacts:\n  policy:\n    path: models/policy\n    type: model\n")
    shutil.copy(REPO / "requirements.lock", "requirements.lock")
    subprocess.run(["git", "add", "-A"], check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "project"], check=True)
    monkeypatch.chdir(project / "data")
    assert run_cli("models", "assign", "policy", "v9") == 2  # the project's dvc.yaml declares policy
    assert "policy has no version v9.0.0 (registered: none)" in capsys.readouterr().err
    assert run_cli("lineage", "policy@v1") == 2
    assert "policy has no version v1.0.0" in capsys.readouterr().err
    assert run_cli("environment") == 0
    assert "`requirements.lock` sha256" in capsys.readouterr().out
    assert run_cli("models", "--root", str(project / "data")) == 0  # a folder inside the project names it
    assert capsys.readouterr().out.startswith("no registered versions yet")
    # outside any project, or a --root that is no folder: one paragraph, exit 2, nothing written
    monkeypatch.chdir(tmp_path)
    for argv in (["models"], ["lineage", "--diff", "policy@v1", "policy@v2"], ["models", "--root", "nope"]):
        assert run_cli(*argv) == 2
        err = capsys.readouterr().err
        assert "Run `rlhf " in err and "nothing was read or written" in err and "Traceback" not in err
        assert ("is not a folder" if "nope" in argv else f"{tmp_path}, is not in a DVC project") in err
    assert run_cli("environment", "--root", "nope") == 2
    assert "--root nope is not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("profile", sorted(p.stem for p in (REPO / "params").glob("*.yaml")))
def test_every_profile_is_valid_and_spells_out_every_tracked_key(profile):
    raw = read_params_file(REPO / "params" / f"{profile}.yaml")
    parse_params(raw, profile)
    assert missing_key_problems(raw, declared_keys_by_stage(REPO)) == []


def test_the_shipped_params_file_is_the_cpu_profile():
    assert (REPO / "params.yaml").read_bytes() == (REPO / "params" / "cpu.yaml").read_bytes()


def test_the_gpu_profile_is_the_cpu_recipe_at_the_reference_label_count():
    """params/gpu.yaml's header: the CPU profile's recipe with the reference's label count; besides it only the
    device and the sampling stages' batch sizes differ."""
    from dvc.utils.flatten import flatten  # the dotted keys DVC tracks params by

    cpu, gpu = (flatten(read_params_file(REPO / "params" / f"{name}.yaml")) for name in ("cpu", "gpu"))
    assert {key for key in cpu.keys() | gpu.keys() if cpu.get(key) != gpu.get(key)} == {
        "compute.device",
        "data.preferences.num_labels",
        "data.corpus.batch_size",
        "data.preferences.batch_size",
        "reward.normalize.batch_size",
        "evaluate.batch_size",
    }
    assert gpu["compute.device"] == "cuda"
    assert gpu["data.preferences.num_labels"] == Params().data.preferences.num_labels == 4992


def test_profile_command_switches_params_and_refuses_a_broken_profile(tmp_path, monkeypatch, capsys):
    shutil.copytree(REPO / "params", tmp_path / "params")
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    assert run_cli("profile") == 0 and capsys.readouterr().out.split() == ["cpu", "gemma", "gpu", "reference", "tiny"]
    assert run_cli("profile", "gemma") == 0  # before its GGUF is fetched: base_model is what reads the file
    assert load_params("params.yaml").base_model.source == "data/models/gemma-3-270m-q4_k_m.gguf"
    assert run_cli("profile", "tiny") == 0
    assert Path("params.yaml").read_bytes() == Path("params/tiny.yaml").read_bytes()
    assert load_params("params.yaml").base_model.source == "tiny-llama"
    Path("params/broken.yaml").write_text(Path("params/tiny.yaml").read_text().replace("lr: 0.0001", "lr: .inf"))
    assert run_cli("profile", "broken") == 2
    assert "ppo.lr" in capsys.readouterr().err
    assert Path("params.yaml").read_bytes() == Path("params/tiny.yaml").read_bytes(), "params.yaml was touched"
    assert run_cli("profile", "nope") == 1
    capsys.readouterr()
    # a --params with no params/ beside it used to list "no profiles" and exit 0
    assert run_cli("profile", "--params", str(tmp_path / "nowhere" / "params.yaml")) == 2
    assert f"no profiles folder {tmp_path / 'nowhere' / 'params'}" in capsys.readouterr().err
    # a folder given for the params file is called a folder, not "not found"
    assert run_cli("check-params", "params") == 2
    assert "params is a folder; give a params file" in capsys.readouterr().err


def test_check_params_and_profile_work_beside_a_dvc_added_file(tmp_path, monkeypatch, capsys):
    """`dvc add data/models/x` (the README's own step) and the flow's ingest make .dvc files, which DVC's
    index lists among the stages: they declare no params and must not break the declared-keys walk."""
    shutil.copytree(REPO / "params", tmp_path / "params")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], check=True)
    Path("data/labels").mkdir(parents=True)
    Path("data/labels/batch.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "data/labels/batch.jsonl"], check=True)
    assert Path("data/labels/batch.jsonl.dvc").is_file()
    declared = declared_keys_by_stage(tmp_path)
    assert "train_policy" in declared and len(declared) == len(declared_keys_by_stage(REPO))
    assert run_cli("check-params") == 0 and capsys.readouterr().out.startswith("ok")
    assert run_cli("profile", "tiny") == 0


def test_tiny_random_source_builds_a_two_block_model():
    model, tokenizer, provenance = load_source_model("tiny-llama")
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token_id is not None
    assert provenance["source"] == "tiny-llama"


def test_no_command_writes_over_its_own_input(tmp_path, monkeypatch, capsys):
    """An output that is the input, or inside an input folder, is refused before anything is read or
    written; Data Docs go only to a new folder or over earlier Data Docs. Each of these used to lose data:
    `--result FILE` replaced the file with GX's JSON, `--docs data/labels` emptied the labels folder,
    `label import export.json export.json` replaced the export with its rows."""
    monkeypatch.chdir(tmp_path)
    labels = Path("labels")
    labels.mkdir()
    rows = "".join(f'{{"query": "q{i}", "sample0": "a{i}", "sample1": "b{i}", "best": 0}}\n' for i in range(8))
    (labels / "round.jsonl").write_text(rows)
    (labels / "notes.txt").write_text("mine\n")
    DatasetDict({"train": Dataset.from_list([{"query": "q", "query_ids": [1]}])}).save_to_disk("queries")

    def kept() -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = kept()
    refusals = {
        (
            "validate-preferences",
            "labels/round.jsonl",
            "--result",
            "labels/round.jsonl",
        ): "is also this command's input",
        ("validate-preferences", "labels/round.jsonl", "--result", "./labels/../labels/round.jsonl"): "is also",
        ("validate-preferences", "labels/round.jsonl", "--docs", "labels"): "labels holds what is not a Data Docs page",
        ("label", "import", "labels/round.jsonl", "labels/round.jsonl"): "is also this command's input",
        ("export-preferences", "queries/pairs.jsonl", "--input", "queries"): "is inside queries, which this command",
        ("label", "export", "queries/tasks.json", "--queries", "queries", "--model", "m"): "is inside queries",
        ("label", "compare", "m", "n", "m/tasks.json", "--queries", "queries"): "is inside m, which this command",
    }
    for argv, said in refusals.items():
        assert run_cli(*argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and err.rstrip().endswith("nothing was written.") and "Traceback" not in err, err
    assert kept() == before, "an input was changed"
    # earlier Data Docs are replaced, as before
    assert run_cli("validate-preferences", "labels/round.jsonl", "--docs", "docs") == 3  # 8 rows: under min_rows
    (Path("docs") / "stale.html").write_text("old page")
    assert run_cli("validate-preferences", "labels/round.jsonl", "--docs", "docs") == 3
    assert sorted(p.name for p in Path("docs").iterdir()) == ["index.html", "round.html"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("label", "export", "t.json", "--n", "100000"), "argument --n: 100,000 is not a whole number from 2 to 64"),
        (("label", "export", "t.json", "--n", "1"), "argument --n: 1 is not a whole number from 2 to 64"),
        (("label", "export", "t.json", "--num", "0"), "argument --num: 0 is not a whole number of at least 1"),
        (("label", "export", "t.json", "--seed", "-1"), "argument --seed: -1 is not a whole number from 0 to"),
        (("label", "export", "t.json", "--round", "-2"), "argument --round: -2 is not a whole number from 0 to"),
        (("label", "config", "--n", "x"), "argument --n: 'x' is not a whole number"),
        (("label", "compare", "a", "b", "c.json", "--num", "0"), "argument --num: 0 is not a whole number"),
        (("label", "import", "e.json", "o.jsonl", "--min-agreement", "nan"), "'nan' is not a share from 0 to 1"),
        (("label", "import", "--from-server", "0", "o.jsonl"), "argument --from-server: 0 is not a whole number"),
    ],
)
def test_a_number_argument_out_of_its_range_is_a_usage_error_before_anything_runs(
    tmp_path, monkeypatch, capsys, argv, message
):
    """`label export --n 100000` sampled until the kernel killed it; `--num 0` and `--n 0` ended in
    tracebacks; `--n 1`, `--round -2` and `--seed -1` wrote tasks `rlhf label import` refuses back;
    `--min-agreement nan` would pass any export."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def _subcommands(parser, path=()):
    """(words, parser) of every subcommand of ``parser``, nested ones included."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subcommands(sub, (*path, name))


def test_every_subcommand_s_help_says_what_it_does_and_shows_an_example(capsys):
    """`rlhf models gate --help` repeated the group's help, and most commands had no example."""
    from rlhf_pipeline.cli import build_parser

    found = list(_subcommands(build_parser()))
    assert {" ".join(words) for words, _ in found} >= {"models gate", "models get", "label import", "profile"}
    for words, _ in found:
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        shown = capsys.readouterr().out
        usage, description = shown.split("\n\n")[:2]
        assert usage.startswith(f"usage: rlhf {' '.join(words)}") and description.strip().endswith("."), shown
        assert "\nexample" in shown and f"  rlhf {words[0]}" in shown.split("\nexample")[-1], shown
    profile = dict(found)[("profile",)].format_help()
    assert all(name in profile for name in ("cpu", "tiny", "reference", "gpu", "gemma"))
