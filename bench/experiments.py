"""Run a set of `dvc exp` experiments on the default pipeline and tabulate what they produced.

Used by ``bench/alignment_study.py`` (one knob at a time) and ``bench/seeds.py`` (the shipped
configuration over several seeds). Everything goes through DVC itself: each configuration is
queued with ``dvc exp run --queue --name NAME --set-param KEY=VALUE``, the queue runs one at a
time (``dvc exp run --run-all --jobs 1``: two torch processes at once on 2 cores would distort the
times), and results are read back with ``dvc.api.exp_show``. Stages a configuration does not change
are taken from DVC's cache, so an experiment only runs the stages downstream of its change.

Wall time: every stage prints ``stage NAME: done in N s`` (from process start); an experiment's
pipeline time is the sum over all stages of the time of the run that produced each stage's
outputs, i.e. its own log (``dvc queue logs NAME``) for the stages it reran and the baseline's
log (``--baseline-log``, the default run's ``dvc repro`` output) for the ones it reused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_pipeline import metric_keys as keys
from rlhf_pipeline.gitrepo import file_at, git

REPO = Path(__file__).resolve().parents[1]
STAGE_TIME = re.compile(r"^stage (\w+): done in (\d+) s", re.MULTILINE)
METRICS = {  # column: metric key as `dvc exp show` names it (file-prefixed only when ambiguous)
    "RM test acc": keys.RM_ACCURACY,
    "label ceiling": "test/ceiling_accuracy",
    "gold gain (base σ)": keys.GOLD_GAIN,
    "± SE": keys.GOLD_GAIN_SE,
    "proxy gain (base σ)": keys.PROXY_GAIN,
    "KL": keys.KL,
    "KL SE": keys.KL_SE,
    "exact KL": keys.KL_EXACT,  # the judge of a KL limit: its SE is a fraction of the estimator's
    "exact KL SE": keys.KL_EXACT_SE,
    "queries": keys.GOLD_QUERIES,
}


@dataclass
class Experiment:
    name: str
    overrides: dict[str, str]
    note: str = ""
    metrics: dict[str, float | None] = field(default_factory=dict)
    stage_seconds: dict[str, int] = field(default_factory=dict)
    reran: list[str] = field(default_factory=list)


def dvc_env() -> dict[str, str]:
    """Stage commands call `python`: put this interpreter's bin directory first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    return env


def dvc(*args: str, capture: bool = False) -> str:
    dvc_bin = str(Path(sys.executable).parent / "dvc")
    done = subprocess.run([dvc_bin, *args], cwd=REPO, env=dvc_env(), text=True, capture_output=capture, check=True)
    return done.stdout if capture else ""


def stage_times(log: str) -> dict[str, int]:
    """``stage NAME: done in N s`` lines of a `dvc repro` log (the last one per stage wins)."""
    return {name: int(seconds) for name, seconds in STAGE_TIME.findall(log)}


def exp_rows() -> list[dict]:
    from dvc.api import exp_show  # (not `import dvc.api`: that name would shadow dvc() here)

    # experiments of earlier commits too: a study queued before later commits is still this study (with
    # only the last 5, a study resumed after 5 commits queued its finished experiments again)
    return exp_show(repo=str(REPO), num=50)


def existing_experiments() -> dict[str, dict]:
    return {row["Experiment"]: row for row in exp_rows() if row.get("Experiment")}


def run_all(experiments: list[Experiment]) -> None:
    """Queue the experiments not yet run (by name), then run the queue one at a time."""
    done = existing_experiments()
    queued = [e for e in experiments if e.name not in done]
    for experiment in queued:
        sets = [arg for key, value in experiment.overrides.items() for arg in ("--set-param", f"{key}={value}")]
        dvc("exp", "run", "--queue", "--name", experiment.name, *sets)
    if queued:
        dvc("exp", "run", "--run-all", "--jobs", "1")


def metric(row: dict, key: str) -> float | None:
    for column, value in row.items():
        if column == key or column.endswith(f":{key}"):
            return value
    return None


def experiment_logs(paths: list[Path]) -> dict[str, str]:
    """The output of experiments run outside the queue (``dvc exp run --temp -n NAME ... > log``), by the
    name their first line reports (``Reproducing experiment 'NAME'``)."""
    logs = {}
    for path in paths:
        text = path.read_text(errors="replace")
        found = re.search(r"Reproducing experiment '([^']+)'", text[:2000])
        if found is None:
            raise SystemExit(f"{path}: no \"Reproducing experiment 'NAME'\" line: not the output of `dvc exp run`")
        logs[found.group(1)] = text
    return logs


RM_ACCURACY_LINE = re.compile(r"^train_reward: test accuracy ([0-9.]+) ", re.MULTILINE)


def logged_metrics(log: str, source: str) -> dict[str, float | None]:
    """The table's metrics as a run's output printed them: ``evaluate``'s metrics (the JSON object it
    prints) and ``train_reward``'s test accuracy (3 decimals). For runs whose results are gone (a
    ``--temp`` experiment in a clone since deleted) but whose logs were kept. The label ceiling on the
    test rows is not printed (``preferences`` prints the ceiling over all labels), so it is None."""
    start = log.rfind("Running stage 'evaluate'")
    opening = log.find("\n{\n", start)
    closing = log.find("\n}\n", opening)
    if start < 0 or opening < 0 or closing < 0:
        raise SystemExit(f"{source}: no metrics printed by the evaluate stage (was the run complete?)")
    printed = json.loads(log[opening + 1 : closing + 2])
    accuracy = RM_ACCURACY_LINE.search(log)
    if accuracy is None:
        raise SystemExit(f"{source}: no 'train_reward: test accuracy' line (did this run train its reward model?)")
    printed[keys.RM_ACCURACY] = float(accuracy.group(1))
    return {column: printed.get(key) for column, key in METRICS.items()}


def collect(
    experiments: list[Experiment],
    baseline_times: dict[str, int],
    run_logs: dict[str, str] | None = None,
    from_logs: bool = False,
) -> dict[str, float | None]:
    """Fill each experiment's metrics and stage times (from ``run_logs`` where it has the experiment's
    output, else from the queue's log); return the workspace (baseline) metrics. ``from_logs``: the
    metrics too come from ``run_logs`` (:func:`logged_metrics`), not from `dvc exp show`, and the
    baseline's are the caller's to read."""
    run_logs = run_logs or {}
    if from_logs:
        missing = [e.name for e in experiments if e.name not in run_logs]
        if missing:
            raise SystemExit(f"--from-logs: no --run-logs file is the output of {', '.join(missing)}")
        rows = {}
        workspace: dict = {}
    else:
        rows = existing_experiments()
        workspace = next(row for row in exp_rows() if row.get("rev") == "workspace")
    for experiment in experiments:
        if from_logs:
            experiment.metrics = logged_metrics(run_logs[experiment.name], experiment.name)
        elif (row := rows.get(experiment.name)) is None:
            raise SystemExit(
                f"experiment {experiment.name!r} did not produce a result: see `dvc queue logs {experiment.name}`"
            )
        else:
            experiment.metrics = {column: metric(row, key) for column, key in METRICS.items()}
        log = run_logs.get(experiment.name) or dvc("queue", "logs", experiment.name, capture=True)
        own = stage_times(log)
        experiment.reran = list(own)
        experiment.stage_seconds = {**baseline_times, **own}
    return {column: metric(workspace, key) for column, key in METRICS.items()}


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def with_se(value: float | None, se: float | None, digits: int = 3) -> str:
    """``value ± se``; the value alone where the SE was not measured (an evaluation from before it was)."""
    return fmt(value, digits) if se is None else f"{fmt(value, digits)} ± {fmt(se, digits)}"


def table_row(label: str, change: str, seconds: dict[str, int], metrics: dict[str, float | None], reran: str) -> str:
    total = sum(seconds.values())
    gain = with_se(metrics["gold gain (base σ)"], metrics["± SE"])
    return (
        f"| {label} | {change} | {total // 60}:{total % 60:02d} | {reran} | {fmt(metrics['RM test acc'])} "
        f"(ceiling {fmt(metrics['label ceiling'])}) | {gain} | {fmt(metrics['proxy gain (base σ)'])} | "
        f"{with_se(metrics['KL'], metrics['KL SE'], 2)} | {with_se(metrics['exact KL'], metrics['exact KL SE'], 2)} |"
    )


def render(
    experiments: list[Experiment],
    baseline_times: dict[str, int],
    baseline_metrics: dict[str, float | None],
    baseline_label: str,
) -> str:
    lines = [
        "| experiment | change from params.yaml | pipeline wall time | stages rerun | RM best-of-4 test accuracy | "
        "gold gain ± paired SE | proxy gain | KL ± SE | exact KL ± SE |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
        table_row(baseline_label, "(shipped)", baseline_times, baseline_metrics, "all"),
    ]
    for e in experiments:
        change = ", ".join(f"`{k}={v}`" for k, v in e.overrides.items())
        lines.append(
            table_row(
                e.name,
                change + (f" ({e.note})" if e.note else ""),
                e.stage_seconds,
                e.metrics,
                ", ".join(e.reran) or "none",
            )
        )
    return "\n".join(lines)


def experiment_file(name: str, path: str) -> str:
    """A file of experiment ``name``'s result commit (its ref under refs/exps), as text."""
    refs = (git(REPO, "for-each-ref", "--format=%(refname)", "refs/exps") or "").split()
    ref = next((r for r in refs if r.rsplit("/", 1)[-1] == name), None)
    text = file_at(REPO, ref, path) if ref else None
    if text is None:
        raise SystemExit(f"experiment {name!r}: no result commit under refs/exps with {path}")
    return text


def curve_text(points: list[dict]) -> str:
    """``KL → gold`` at each checkpoint of an over-optimisation curve (gold in base σ), base point left out."""
    return ", ".join(f"{p['kl']:.2f} → {p['gold_std_units']:.2f}" for p in points if p["update"] > 0)


def curves(experiments: list[Experiment], curve_file: str = "evaluation/overoptimization.json") -> str:
    """Gold against KL checkpoint by checkpoint: the workspace's run, then each experiment's."""
    lines = ["| run | KL → gold (base σ), checkpoint by checkpoint |", "|---|---|"]
    lines.append(f"| default | {curve_text(json.loads((REPO / curve_file).read_text()))} |")
    for e in experiments:
        lines.append(f"| {e.name} | {curve_text(json.loads(experiment_file(e.name, curve_file)))} |")
    return "\n".join(lines)


def seed_summary(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return fmt(present[0]) if present else "n/a"
    return f"{statistics.mean(present):.3f} (sd {statistics.stdev(present):.3f})"


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--baseline-log",
        type=Path,
        required=True,
        help="the default run's `dvc repro` output (stage times of the stages an experiment reuses)",
    )
    p.add_argument("--output", type=Path, help="also write the report here")
    p.add_argument("--no-run", action="store_true", help="only tabulate experiments already run")
    return p


def emit(report: str, output: Path | None) -> None:
    print(report)
    if output is not None:
        output.write_text(report + "\n")
        print(f"(written to {output})")
