"""Versions over time on the tiny pipeline: the registry (GTO tags over dvc.yaml's artifacts), the
promotion gate both ways, lineage of any version and between two, rollback with exact bytes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from test_lineage import _validate_event
from test_pipeline_e2e import BIN, sh

from rlhf_pipeline.io import CHECKSUMS, checksum_problems, read_checksums
from rlhf_pipeline.project_key import project_key, pseudonym

pytestmark = pytest.mark.e2e


# --------------------------------------------------------------------------------------------
# the registry on a tiny project
# --------------------------------------------------------------------------------------------
def rlhf(root: Path, *args: str, check: bool = True):
    return sh(["rlhf", *args], root, check=check)


def set_promotion(root: Path, **rule) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["promotion"] = {**params.get("promotion", {}), **rule}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def retrain(root: Path, **ppo) -> None:
    """A second round: PPO again with other settings, committed as the flow commits it."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["ppo"].update(ppo)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh(["dvc", "repro"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "run 2"], root)


def gate(root: Path) -> dict:
    return json.loads(rlhf(root, "models", "gate", "--json").stdout)


def prod_of(root: Path, name: str = "policy") -> str | None:
    shown = sh(["gto", "show", f"{name}#prod", "--ref"], root, check=False)
    return shown.stdout.strip() or None


def test_the_dvc_registry_sees_the_declared_artifacts(versioned):
    artifacts = yaml.safe_load((versioned / "dvc.yaml").read_text())["artifacts"]
    assert artifacts["policy"]["path"] == "models/policy" and artifacts["policy"]["type"] == "model"
    assert artifacts["reward-model"]["path"] == "models/reward"
    assert "ppo" in artifacts["policy"]["labels"]
    assert "no registered versions yet" in rlhf(versioned, "models").stdout


def test_gate_both_ways_register_every_version_and_roll_back(versioned, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(versioned, root, symlinks=True)
    rows = [json.loads(line) for line in (root / "evaluation/responses.jsonl").read_text().splitlines()]
    assert len(rows) == json.loads((root / "metrics/evaluate.json").read_text())["queries"]

    # first version: against the base model, by the same rule; a KL budget it exceeds keeps it out
    set_promotion(root, max_kl=1.0e-9, min_queries=2)
    first = gate(root)
    assert first["registered"] == "policy@v1.0.0, reward-model@v1.0.0"
    assert first["decision"]["promote"] is False and first["decision"]["comparison"]["incumbent"] == "base model"
    assert "KL to the base" in first["markdown"] and "not promoted" in first["markdown"]
    assert prod_of(root) is None
    # the same HEAD again: no new version, nothing decided
    again = gate(root)
    assert again["decision"] is None and "no new version" in again["outcome"]

    # the rule's thresholds the other way: v1 is already registered, so assign by hand, as a person would
    assert "policy@v1.0.0 is now prod" in rlhf(root, "models", "assign", "policy", "v1").stdout
    assert prod_of(root) == "policy@v1.0.0"

    # a second round, judged against prod (v1) on the same held-out queries, by a frozen judge: the
    # reward model registered with v1, fetched and checked at its version, whatever the workspace holds
    retrain(root, lr=3.0e-4)
    set_promotion(root, max_kl=None, tolerance_se=100.0, min_queries=2, judge="reward-model@v1")
    sh(["git", "commit", "-qam", "rule"], root)
    second = gate(root)
    decision = second["decision"]
    assert decision["comparison"]["gold"] is not None and decision["comparison"]["judge"] == "reward-model@v1"
    assert "- frozen judge reward-model@v1: " in second["markdown"] and not list(root.glob(".judge-*"))
    assert second["registered"] == "policy@v2.0.0, reward-model@v1.0.0"  # the reward model did not change
    assert decision["promote"] is True and decision["comparison"]["incumbent"] == "policy@v1.0.0"
    assert decision["comparison"]["queries"] == len(rows)
    assert prod_of(root) == "policy@v2.0.0"

    # (a rejected challenger while prod exists, and the flow around the gate: tests/test_flow.py)
    listing = json.loads(rlhf(root, "models", "--json").stdout)
    policy = [row for row in listing if row["artifact"] == "policy"]
    assert [row["version"] for row in policy] == ["v2.0.0", "v1.0.0"]
    # the tiny model has no gold spread (its gain is undefined, null): KL and the RM accuracy are there
    assert policy[0]["stages"] == ["prod"] and policy[0]["KL"] is not None and policy[0]["RM accuracy"] is not None
    table = rlhf(root, "models").stdout
    assert "| policy | v2.0.0 | prod |" in table and "RM accuracy" in table

    # rollback: prod back to v1, fetched while the workspace holds v2, byte for byte as v1's SHA256SUMS
    sh(["dvc", "push", "-q"], root)
    rlhf(root, "models", "assign", "policy", "v1")
    assert prod_of(root) == "policy@v1.0.0"
    listed = json.loads(rlhf(root, "models", "--json").stdout)
    stages = {row["version"]: row["stages"] for row in listed if row["artifact"] == "policy"}
    assert stages["v1.0.0"] == ["prod"] and stages["v2.0.0"] == []
    fetched = tmp_path / "prod-policy"
    out = rlhf(root, "models", "get", "policy", "--from-stage", "prod", "--as-recorded", "-o", str(fetched)).stdout
    assert "policy@v1.0.0" in out and "match its SHA256SUMS" in out and "held-out results" not in out
    v1_sums = sh(["git", "show", "policy@v1.0.0:dvc.lock"], root).stdout
    workspace_sums = read_checksums(root / "models/policy" / CHECKSUMS)
    assert read_checksums(fetched / CHECKSUMS) != workspace_sums  # the workspace moved on (v2)
    assert checksum_problems(fetched, read_checksums(fetched / CHECKSUMS)) == []
    assert "models/policy" in v1_sums
    # DVC's own command agrees with ours (the docs' way)
    dvc_out = tmp_path / "dvc-get"
    sh(["dvc", "artifacts", "get", str(root), "policy", "--stage", "prod", "-o", str(dvc_out)], tmp_path)
    assert read_checksums(dvc_out / CHECKSUMS) == read_checksums(fetched / CHECKSUMS)

    # the card a user gets: v1's card gains the held-out results its commit recorded (in its text and as
    # its model-index), the rest is v1's bytes, and SHA256SUMS names the new card
    from huggingface_hub import ModelCard

    published = tmp_path / "published"
    out = rlhf(root, "models", "get", "policy", "v1", "-o", str(published)).stdout
    assert "the card holds the version's held-out results" in out
    v1_measured = json.loads(sh(["git", "show", "policy@v1.0.0:metrics/evaluate.json"], root).stdout)
    card = ModelCard.load(published / "README.md")
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results["kl"] == round(v1_measured["kl/mean"], 4)
    assert results["win_rate"] == round(v1_measured["win_rate/gold"], 4)
    # the tiny model's gain is often undefined (every base response scored alike: null), and then left out,
    # not written as 0; whether it is depends on the tokens sampled, so on the CPU
    gain = v1_measured.get("gold/improvement_in_base_std")
    assert results.get("gold_gain") == (None if gain is None else round(gain, 4))
    assert card.data.model_name and "policy@v1.0.0" in card.text
    assert f"- KL from the base model (nats per response): {results['kl']:.4g}\n" in card.text
    assert checksum_problems(published, read_checksums(published / CHECKSUMS)) == []
    changed = {
        f for f, h in read_checksums(published / CHECKSUMS).items() if read_checksums(fetched / CHECKSUMS)[f] != h
    }
    assert changed == {"README.md"}

    # lineage of a version, without checking anything out, and between two versions
    text = rlhf(root, "lineage", "policy@v1").stdout
    assert "as recorded at" in text and "Lineage of models/policy" in text
    events = [
        json.loads(rlhf(root, "lineage", spec, "--json").stdout) for spec in ("policy@v1", "policy@v1", "policy@v2")
    ]
    for event in events:
        _validate_event(event)
    assert events[0]["run"]["runId"] == events[1]["run"]["runId"] != events[2]["run"]["runId"]
    by_rev = json.loads(rlhf(root, "lineage", "models/policy", "--rev", "policy@v1.0.0", "--json").stdout)
    assert by_rev["run"]["runId"] == events[0]["run"]["runId"]
    diff = json.loads(rlhf(root, "lineage", "--diff", "policy@v1", "policy@v2", "--json").stdout)
    changes = diff["changes"]
    assert changes["params"]["ppo.lr"] == {"old": 1.0e-4, "new": 3.0e-4}
    assert changes["preferenceRows"]["added"] == 0 and changes["preferenceRows"]["removed"] == 0
    assert changes["code"] == {} and changes["environment"]["same"] is True
    assert any(key.startswith("metrics/evaluate.json/") for key in changes["metrics"]), changes["metrics"]
    assert "ppo.lr: 0.0001 -> 0.0003" in rlhf(root, "lineage", "--diff", "policy@v1", "policy@v2").stdout


def people_answer(root: Path, answers: dict[str, str]) -> None:
    """Each person (annotator id -> "challenger" | "incumbent" | "tie") answers every side-by-side task
    of the project's one round, as Label Studio exports it; then `rlhf label verdicts`."""
    (path,) = (root / "side_by_side").glob("*.json")
    order = json.loads(path.read_text())["order"]
    tasks = json.loads((root / "tasks.json").read_text())

    def choice(prefers: str, a_is: str) -> str:
        return "tie" if prefers == "tie" else ("a" if prefers == a_is else "b")

    def annotation(who: str, prefers: str, task_id: str) -> dict:
        value = {"choices": [choice(prefers, order[task_id])]}
        return {"completed_by": who, "result": [{"from_name": "best", "type": "choices", "value": value}]}

    export = [
        {
            "id": n,
            "data": t["data"],
            "annotations": [annotation(w, p, t["data"]["task_id"]) for w, p in answers.items()],
        }
        for n, t in enumerate(tasks)
    ]
    (root / "export.json").write_text(json.dumps(export))
    rlhf(root, "label", "verdicts", "export.json")


def test_the_human_gate_waits_for_people_then_decides_both_ways(versioned, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(versioned, root, symlinks=True)
    human = {"num_queries": 6, "min_judgements": 10, "min_annotators": 2}
    set_promotion(root, score="human", judge=None, max_kl=None, min_queries=2, human=human)
    sh(["git", "commit", "-qam", "the gate asks people"], root)

    # no round yet: the challenger is registered and waits, and the gate says how to run the round
    waiting = gate(root)
    assert waiting["decision"] is None and waiting["waiting"] and prod_of(root) is None
    assert waiting["registered"] == "policy@v1.0.0, reward-model@v1.0.0"
    assert "rlhf label compare policy@v1.0.0 models/base tasks.json" in waiting["outcome"]
    made = rlhf(root, "label", "compare", "policy@v1", "models/base", "tasks.json")
    assert "kept in side_by_side/policy@v1.0.0_vs_models-base.json" in made.stdout
    tasks = json.loads((root / "tasks.json").read_text())
    assert len(tasks) >= 5 and all(t["data"]["versions"] == ["models/base", "policy@v1.0.0"] for t in tasks)
    other = tmp_path / "other"
    shutil.copytree(root, other, symlinks=True)

    # one person's answers are too few: it still waits, and the round (order and verdicts) is committed
    people_answer(root, {"1": "challenger"})
    assert f"{len(tasks)} verdicts from 1 person; the rule needs at least 10 from at least 2" in gate(root)["outcome"]
    assert "side_by_side/policy@v1.0.0_vs_models-base.json" in sh(["git", "show", "--stat", "HEAD"], root).stdout
    assert prod_of(root) is None

    # forged by hand: six copies of one person's answer and four verdicts for tasks the round never made
    # would reach the rule's 10 from 2 people; the round's seal no longer agrees, so nothing is counted
    round_file = root / "side_by_side" / "policy@v1.0.0_vs_models-base.json"
    kept = round_file.read_text()
    forged = json.loads(kept)
    one = forged["verdicts"][0]
    forged["verdicts"] += [dict(one)] * 6 + [dict(one, task_id=f"{n:016x}", annotator="x") for n in range(4)]
    round_file.write_text(json.dumps(forged))
    refused = rlhf(root, "models", "gate", "--json", check=False)
    assert refused.returncode == 3 and "its seal does not agree" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and prod_of(root) is None
    round_file.write_text(kept)
    # a second person agrees: the challenger wins every verdict, and takes prod
    people_answer(root, {"1": "challenger", "2": "challenger"})
    decided = gate(root)
    assert decided["decision"]["promote"] is True and decided["decision"]["score"] == "human"
    assert prod_of(root) == "policy@v1.0.0"
    n = 2 * len(tasks)
    assert f"| challenger vs base model | {n} | {n} | 0 | 0 | 100.0% |" in decided["markdown"]
    first, second = sorted(pseudonym(person, project_key(root)) for person in ("1", "2"))  # people by pseudonym
    shares = f"- Each person's share of the verdicts: {first} {len(tasks)} (50%), {second} {len(tasks)} (50%)"
    assert shares in decided["markdown"]
    assert "no new version" in gate(root)["outcome"]  # decided: prod has it

    # the other way: both people prefer the base model's responses; the version stays registered, not prod
    people_answer(other, {"1": "incumbent", "2": "incumbent"})
    refused = gate(other)
    assert refused["decision"]["promote"] is False and prod_of(other) is None
    assert "prod stays unassigned; policy@v1.0.0 is registered, not promoted" in refused["outcome"]
    assert "stays below 50%: beyond tolerance" in refused["markdown"]


def test_lineage_warns_when_the_running_environment_is_not_the_one_that_made_the_artifact(versioned, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(versioned, root, symlinks=True)
    assert "the same packages (reproducible here)" in rlhf(root, "lineage", "models/policy").stdout
    # as if the policy had been trained with another transformers than the one installed now
    card = root / "models/policy/README.md"
    text = card.read_text()
    assert "    differs_from_lock: {}\n" in text
    card.write_text(
        text.replace(
            "    differs_from_lock: {}\n", "    differs_from_lock: {transformers: {locked: x, installed: 4.0.0}}\n"
        )
    )
    out = rlhf(root, "lineage", "models/policy").stdout
    assert (
        "WARNING      the running environment differs from the one that made this artifact: transformers 4.0.0 ->"
        in out
    )
    assert "differing from it: transformers" in out
    # a lock regenerated with the same installed packages is no difference
    lock = root / "requirements.lock"
    card.write_text(text)
    lock.write_text(lock.read_text() + "\n# regenerated\n")
    assert "the same packages (reproducible here)" in rlhf(root, "lineage", "models/policy").stdout


def test_a_bad_version_or_revision_is_one_paragraph(versioned):
    for args, expected in (
        (("lineage", "policy@v9"), "has no version v9.0.0"),
        (("lineage", "models/policy", "--rev", "no-such-branch"), "git knows no such revision"),
        (("models", "assign", "policy", "v7"), "has no version v7.0.0"),
        (("models", "get", "nothing", "-o", "x"), "declares no artifact 'nothing'"),
        (("models", "get", "reward-model", "--with-results", "-o", "x"), "card already holds its held-out results"),
        (("models", "get", "reward-model", "-o", "x"), "`rlhf models gate` registers HEAD's policy"),
    ):
        result = rlhf(versioned, *args, check=False)
        assert result.returncode != 0 and expected in result.stderr and "Traceback" not in result.stderr


HOSTILE_NAMES = (
    "--output=../outside/x",
    "-c core.sshCommand=touch ../outside/pwned",
    "HEAD:../../etc/passwd",
    "policy@v1;touch ../outside/y",
    "policy@" + "v" * 100_000,
    "policy@v1\x00",
    "HEAD\x00--output=../outside/z",
)


def test_a_revision_or_name_from_the_user_is_never_an_option_or_a_path(versioned, tmp_path):
    """`rlhf lineage --rev/--diff`, `rlhf models get NAME`, `rlhf label export --model NAME`: exit 2, one
    paragraph, no git process given the user's text as an option, nothing outside the project written."""
    root = tmp_path / "project"
    shutil.copytree(versioned, root, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    # a git that logs every argv it is given, then runs the real one
    spy = tmp_path / "spy"
    spy.mkdir()
    log = tmp_path / "git-argv.log"
    real_git = shutil.which("git")
    (spy / "git").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec {real_git} "$@"\n')
    (spy / "git").chmod(0o755)
    path = f"{spy}:{BIN}:{os.environ['PATH']}"
    for name in HOSTILE_NAMES:
        if "\x00" in name:  # a NUL cannot be an argv: the exec itself refuses it, as any shell would
            with pytest.raises(ValueError):
                sh(["rlhf", "lineage", "models/policy", "--rev", name], root, check=False, PATH=path)
            continue
        calls = (
            ("lineage", "models/policy", f"--rev={name}"),
            ("lineage", "--diff", name, "models/policy@HEAD"),
            ("lineage", "--diff", "models/policy@HEAD", name),
            ("lineage", name),
            ("models", "get", name, "-o", str(tmp_path / "got")),
            ("label", "export", "--model", name, "--num", "2", str(tmp_path / "tasks.json")),
        )
        for args in calls:
            result = sh(["rlhf", *args], root, check=False, PATH=path)
            shown = " ".join(a[:60] for a in args)
            assert result.returncode == 2, f"{shown}: exit {result.returncode}\n{result.stderr[-2000:]}"
            assert "Traceback" not in result.stderr and len(result.stderr) < 2000, shown
    assert sorted(p.name for p in outside.iterdir()) == []
    assert not (tmp_path / "got").exists() and not (tmp_path / "tasks.json").exists()
    argvs = log.read_text().splitlines() if log.exists() else []
    assert argvs, "git was never called: the spy is not on PATH"
    for line in argvs:  # what each hostile value carries that no git call of the project's own does
        for marker in ("--output=", "sshCommand", "etc/passwd", ";touch", "v" * 50):
            assert marker not in line, f"git saw the user's {marker!r}: git {line[:200]}"


def test_a_tag_pushed_by_hand_or_swapped_bytes_are_refused_and_concurrent_assigns_agree(versioned, tmp_path):
    """A GTO tag on a commit whose dvc.lock records no model is not a version (exit 2 wherever it is
    named, flagged in the listing); bytes that differ from what the version's dvc.lock records are
    never written by `get` (exit 7); two `assign`s at once leave one consistent prod."""
    import subprocess

    root = tmp_path / "project"
    shutil.copytree(versioned, root, symlinks=True)
    set_promotion(root, max_kl=1.0e-9, min_queries=2)
    sh(["git", "commit", "-qam", "rule"], root)
    assert gate(root)["registered"] == "policy@v1.0.0, reward-model@v1.0.0"

    # two assigns at once: both succeed, one after the other, and prod is v1 by tags GTO numbers apart
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    both = [
        subprocess.Popen(["rlhf", "models", "assign", "policy", "v1"], cwd=root, env=env, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    assert [p.wait(timeout=300) for p in both] == [0, 0], [p.stderr.read()[-800:] for p in both]
    assert prod_of(root) == "policy@v1.0.0"
    prod_tags = sh(["git", "tag", "--list", "policy#prod#*"], root).stdout.split()
    assert len(prod_tags) == len(set(prod_tags)) == 2

    # a tag pushed by hand onto a commit that holds no run
    stray = sh(
        [
            "git",
            "commit-tree",
            "-m",
            "stray",
            sh(["git", "hash-object", "-t", "tree", "/dev/null"], root).stdout.strip(),
        ],
        root,
    )
    stray_commit = stray.stdout.strip()
    sh(["git", "tag", "-a", "policy@v9.0.0", "-m", "Registering artifact policy version v9.0.0", stray_commit], root)
    for args in (("models", "get", "policy", "v9", "-o", str(tmp_path / "got")), ("models", "assign", "policy", "v9")):
        result = rlhf(root, *args, check=False)
        assert result.returncode == 2 and "it names no model, so it is not a version" in result.stderr, result.stderr
    assert prod_of(root) == "policy@v1.0.0" and not (tmp_path / "got").exists()
    listed = rlhf(root, "models").stdout
    assert "v9.0.0 | - (not a version: its commit's dvc.lock records no model)" in listed
    # ... and prod moved onto it by hand: whatever reads prod (get, the gate's incumbent) refuses it
    sh(
        [
            "git",
            "tag",
            "-a",
            "policy#prod#9",
            "-m",
            "Assigning stage prod to artifact policy version v9.0.0",
            stray_commit,
        ],
        root,
    )
    result = rlhf(root, "models", "get", "policy", "--from-stage", "prod", "-o", str(tmp_path / "got"), check=False)
    assert result.returncode == 2 and "policy@v9.0.0 is a tag on commit" in result.stderr, result.stderr

    # a DVC cache object of v1's policy swapped for other bytes: `get` refuses, writes nothing
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    tree = next(o["md5"] for s in lock["stages"].values() for o in s.get("outs", []) if o["path"] == "models/policy")
    cache = root / ".dvc" / "cache" / "files" / "md5"
    listing = json.loads((cache / tree[:2] / tree[2:]).read_text())
    config = next(entry["md5"] for entry in listing if entry["relpath"] == "config.json")
    (root / "models" / "policy").rename(root / "policy-moved-away")  # `get` reads the cache, not the workspace
    target = cache / config[:2] / config[2:]
    target.chmod(0o644)
    target.write_text(target.read_text().replace("}", ', "swapped": true}', 1))
    result = rlhf(root, "models", "get", "policy", "v1", "-o", str(tmp_path / "got"), check=False)
    assert result.returncode == 7 and "is not what dvc.lock at its commit" in result.stderr, result.stderr
    assert not (tmp_path / "got").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".got.get-")]


def test_the_gate_decides_through_eight_modules_and_samples_nothing(versioned, tmp_path, capsys):
    """From `rlhf models gate` to the registered decision, with the gold rule and with people's, the
    command and the gate call into at most 8 library modules, themselves included: the gate reads the
    decision's inputs and writes the registration. Sampling, sending and pulling a round are `rlhf label`
    commands that the retrain flow runs around it, so no sampler or Label Studio client is entered."""
    import sys

    from rlhf_pipeline import cli

    command, gate = "rlhf_pipeline.commands.models", "rlhf_pipeline.gate"
    path: set[str] = {command, gate}  # the modules the command's and the gate's own functions call into
    printing = "rlhf_pipeline.redaction"  # the secret filter `rlhf` puts on stdout: every command prints through it
    everything: set[str] = set()  # every library module entered below the command

    def watch(frame, event, arg) -> None:
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("rlhf_pipeline") or frame.f_code.co_name == "<module>":
            return
        everything.add(module)
        caller = frame.f_back.f_globals.get("__name__") if frame.f_back is not None else None
        if caller in (command, gate) and module != printing:
            path.add(module)

    human = {"score": "human", "judge": None, "max_kl": None, "human": {"label_studio_project": 3}}
    for name, rule in (("gold", {}), ("human", human)):
        root = tmp_path / name
        shutil.copytree(versioned, root, symlinks=True)
        set_promotion(root, **rule)
        sh(["git", "commit", "-qam", f"the {name} rule", "--allow-empty"], root)
        capsys.readouterr()
        sys.setprofile(watch)
        try:
            with pytest.raises(SystemExit) as ended:
                cli.main(["models", "gate", "--json", "--root", str(root)])
        finally:
            sys.setprofile(None)
        assert ended.value.code == 0
        decided = json.loads(capsys.readouterr().out)
        assert decided["registered"] == "policy@v1.0.0, reward-model@v1.0.0"
    assert decided["waiting"] and decided["round"] == {
        "challenger": "policy@v1.0.0",
        "incumbent": "models/base",
        "file": "side_by_side/policy@v1.0.0_vs_models-base.json",
        "sampled": False,
        "project": 3,
    }
    assert "`rlhf label compare policy@v1.0.0 models/base --send 3`" in decided["outcome"]
    assert len(path) <= 8, " ".join(sorted(path))
    assert not {m for m in everything if "sampling" in m or "label_studio" in m}, sorted(everything)
