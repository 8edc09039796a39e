"""Helpers of the benchmark scripts: the FLOP count of fused attention with grouped key/value heads and the
step profile's operator groups (bench/common.py), the comparison of two ``dvc.lock`` files
(bench/lock_diff.py), the evaluation's variance components (bench/probe_eval_variance.py), the logs of
experiments run outside the queue and the metrics they print (bench/experiments.py), the reward bench's
page faults a step (bench/reward_throughput.py), the malloc trace's windows
(bench/probe_malloc_trace.py), the reward step's op-by-op timer (bench/common.py, for
bench/probe_reward_ops.py), the sides' processes taking turns and the hypervisor's steal (bench/common.py),
and both throughput benches end to end on the tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks are scripts, not a package

import lock_diff  # noqa: E402
import reward_throughput  # noqa: E402
from common import (  # noqa: E402
    PROFILE_HEADERS,
    OpTimeProfile,
    StepProfile,
    cpu_ticks,
    grouped_query_attention_formulas,
    median_usage,
    op_group,
    run_in_turns,
    steal_note,
    steal_share,
)
from experiments import experiment_logs, logged_metrics  # noqa: E402
from probe_eval_variance import standard_error, variance_components  # noqa: E402
from probe_malloc_trace import windows  # noqa: E402
from process_start import WRAPPER  # noqa: E402
from seeds import seed_experiments  # noqa: E402


def test_grouped_key_value_heads_count_as_the_query_heads_they_serve():
    """SmolLM2 reaches CUDA's fused attention with 9 query heads and 3 key/value heads: the count is that
    of 3 heads repeated to 9 (what the kernel computes), forward and backward, for each fused op."""
    formulas = grouped_query_attention_formulas()
    assert sorted(op.__name__ for op in formulas) == sorted(
        f"_scaled_dot_product_{kind}_attention{part}"
        for kind in ("efficient", "flash", "cudnn")
        for part in ("", "_backward")
    )
    query = torch.empty(2, 9, 5, 64, device="meta")
    grouped, repeated = torch.empty(2, 3, 5, 64, device="meta"), torch.empty(2, 9, 5, 64, device="meta")
    for op, count in formulas.items():
        if op.__name__.endswith("_backward"):  # (grad_out, query, key, value, ...)
            args, expected = (query, query, grouped, grouped), (query, query, repeated, repeated)
            out = (query, repeated, repeated)
        else:  # (query, key, value, ...)
            args, expected, out = (query, grouped, grouped), (query, repeated, repeated), (query,)
        assert count(*args, out_val=out) == flop_registry[op](*expected, out_val=out) > 0


def _lock(path: Path, policy_md5: str, speed_md5: str) -> str:
    """A one-stage ``dvc.lock`` whose two outputs have these hashes."""
    outs = [
        {"path": out, "hash": "md5", "md5": md5, "size": 1}
        for out, md5 in (("models/policy", policy_md5), ("speed.json", speed_md5))
    ]
    path.write_text(yaml.safe_dump({"schema": "2.0", "stages": {"train_policy": {"cmd": "x", "outs": outs}}}))
    return str(path)


def test_lock_diff_names_the_outputs_that_differ_and_fails_on_an_unexpected_one(tmp_path, capsys):
    before = _lock(tmp_path / "a.lock", "aaa", "s1")
    assert lock_diff.main([before, _lock(tmp_path / "b.lock", "aaa", "s2"), "--expect", "speed.json"]) == 0
    assert "train_policy: 1 outputs the same bytes; differ: speed.json" in capsys.readouterr().out
    assert lock_diff.main([before, _lock(tmp_path / "c.lock", "bbb", "s1"), "--expect", "speed.json"]) == 1
    assert "differ: models/policy" in capsys.readouterr().out


def test_variance_components_recover_the_between_and_within_query_spread():
    """Per-response values = a query's effect (sd 2) + the response's own noise (sd 3): the split finds
    4 and 9, and the standard error of one response per query is the plain one over all rows."""
    rng = np.random.default_rng(0)
    values = rng.normal(0, 2, size=(4000, 1)) + rng.normal(0, 3, size=(4000, 3))
    between, within = variance_components(values)
    assert between == pytest.approx(4.0, rel=0.08) and within == pytest.approx(9.0, rel=0.05)
    assert standard_error(4.0, 9.0, queries=100, responses=1) == pytest.approx(np.sqrt(13 / 100))
    # more responses per query shrink only the within part: 4 responses of 100 queries beat 1 of 100
    # but not 1 of 400
    assert standard_error(4.0, 9.0, 400, 1) < standard_error(4.0, 9.0, 100, 4) < standard_error(4.0, 9.0, 100, 1)
    # no spread between queries beyond the responses': the between part is 0, not negative
    assert variance_components(rng.normal(0, 1, size=(2000, 2)))[0] == pytest.approx(0.0, abs=0.05)


@pytest.mark.parametrize(
    ("operator", "group"),
    [
        ("aten::mm", "matrix products"),
        ("aten::addmm", "matrix products"),
        ("aten::matmul", "other"),  # composite: its self time is bookkeeping, the work is in aten::mm
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("aten::_fused_adam_", "optimizer step"),
        ("aten::_foreach_norm", "optimizer step"),
        ("aten::mul", "other"),
        ("aten::silu_backward", "other"),
    ],
)
def test_a_profiled_operator_falls_in_one_group(operator, group):
    assert op_group(operator) == group


def test_the_step_profile_counts_a_matrix_products_time_and_flops_apart_from_the_rest():
    """A profiled 256 x 256 x 256 product and an elementwise op: the product's FLOPs are 2 n^3 and its
    time is in "matrix products", the multiplication's in "other"; the row has every header's cell."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    profile = StepProfile()
    profile.start()
    torch.mm(a, b)
    torch.mul(a, b)
    profile.stop()
    assert profile.matmul_flops == 2 * 256**3
    assert profile.seconds["matrix products"] > 0 and profile.seconds["other"] > 0
    assert profile.seconds["attention"] == 0
    assert any(name.startswith("aten::mul") for name, _ in profile.largest_other)
    assert len(profile.row()) == len(PROFILE_HEADERS)


def test_the_op_time_profile_times_only_between_start_and_stop_and_counts_a_product_s_flops_in_its_group():
    """common.OpTimeProfile (bench/probe_reward_ops.py's timer): ops outside start/stop are not timed; a
    64 x 32 by 32 x 16 product counts 2 * 64 * 32 * 16 FLOPs (torch's formula, addmm's too) and falls in
    "matrix products", a multiplication in "other" under its name; over two profiled steps every reading is a
    step's mean; the row has every header's cell."""
    a, b, bias = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16)
    profile = OpTimeProfile()
    torch.mul(a, a)  # before the first step: not timed
    for _ in range(2):
        profile.start()
        torch.mm(a, b)
        torch.addmm(bias, a, b)
        torch.mul(a, a)
        profile.stop()
        torch.sub(a, a)  # between steps: not timed
    assert profile.steps == 2
    assert profile.matmul_flops == 2 * (2 * 64 * 32 * 16)  # a step's, not the two steps' sum
    assert list(profile.seconds) == ["matrix products", "attention", "optimizer step", "other"]
    assert profile.seconds["matrix products"] > 0 and profile.seconds["attention"] == 0
    assert list(profile.other_seconds) == ["aten::mul"]
    assert profile.seconds["other"] == profile.other_seconds["aten::mul"] > 0
    assert profile.wall >= sum(profile.seconds.values())
    assert len(profile.row()) == len(PROFILE_HEADERS)


def test_an_experiment_run_outside_the_queue_is_found_by_the_name_its_log_reports(tmp_path):
    """bench/seeds.py --run-logs: each log is keyed by its "Reproducing experiment 'NAME'" line; a file
    without one (not the output of `dvc exp run`) stops the report, naming the file."""
    log = tmp_path / "seed_2.log"
    log.write_text("Reproducing experiment 'seed-2-bisect'\nRunning stage 'base_model':\n")
    assert experiment_logs([log]) == {"seed-2-bisect": log.read_text()}
    other = tmp_path / "repro.log"
    other.write_text("Running stage 'base_model':\n")
    with pytest.raises(SystemExit, match="repro.log"):
        experiment_logs([log, other])


def test_a_candidate_default_sets_its_params_on_every_seed_and_a_malformed_set_is_refused():
    """bench/seeds.py --set: each seed's experiment carries the candidate's params besides its seed (what the
    queue passes as --set-param and the table prints as the change); a --set without '=' or one naming the
    seed (--seeds' job) stops the study, naming the argument."""
    runs = seed_experiments([1, 3], "cut", ["data.preferences.num_labels=768", "ppo.kl.budget_check_responses=64"])
    assert [run.name for run in runs] == ["seed-1-cut", "seed-3-cut"]
    assert runs[1].overrides == {
        "seed": "3",
        "data.preferences.num_labels": "768",
        "ppo.kl.budget_check_responses": "64",
    }
    assert seed_experiments([2], "", [])[0].overrides == {"seed": "2"}
    for bad in ("data.preferences.num_labels", "seed=4", "=3"):
        with pytest.raises(SystemExit, match=re.escape(repr(bad))):
            seed_experiments([1], "cut", [bad])


def test_the_metrics_a_run_printed_are_read_from_its_log_and_a_cut_log_is_an_error():
    """bench/seeds.py --from-logs: the evaluate stage's printed JSON (the checkpoint curve's JSON of an
    earlier stage must not be taken for it) and train_reward's accuracy line; the test-row ceiling is not
    printed, so it is None; a log that stops before evaluate's metrics stops the report, naming it."""
    head = (
        "Running stage 'train_reward':\n"
        "train_reward: test accuracy 0.646 on 288 held-out rows; saved models/reward_unnormalized\n"
        "Running stage 'train_policy':\n{\n \"kl/mean\": 9.9\n}\n"
        "Running stage 'evaluate':\nevaluate base: 286/286 queries sampled (26 s)\n"
    )
    log = head + (
        '{\n "kl/mean": 5.398,\n "kl/stderr": 0.266,\n "gold/improvement_in_base_std": 0.899,\n'
        ' "gold/queries": 286,\n "device": "cpu (fp32)"\n}\nstage evaluate: done in 92 s\n'
    )
    read = logged_metrics(log, "seed_3.log")
    assert read["KL"] == 5.398 and read["KL SE"] == 0.266
    assert read["gold gain (base σ)"] == 0.899 and read["queries"] == 286
    assert read["RM test acc"] == 0.646
    assert read["label ceiling"] is None and read["exact KL"] is None
    with pytest.raises(SystemExit, match="seed_4.log: no metrics printed by the evaluate stage"):
        logged_metrics(head, "seed_4.log")


def test_page_faults_a_step_count_each_step_from_its_start_to_its_end_only():
    """usage_now() as each of two timed steps began and ended (faults, system seconds, and the times the bound
    on kept memory gave memory back so far): what happened between the steps (the other side's turn, 490
    faults, 0.9 s, one give-back) is not counted."""
    spans = [((1000, 5.0, 1), (1010, 5.1, 1)), ((1500, 6.0, 2), (1530, 6.3, 4))]
    faults, system, given_back = median_usage(spans)
    assert faults == 20 and system == pytest.approx(0.2) and given_back == 2


def test_the_malloc_trace_sums_faults_and_spans_memory_over_each_window():
    # (seconds, RssAnon, in use, heap, minor faults so far, give-backs so far)
    gb = 10**9
    trace = [
        (0.25, 1 * gb, 0.5 * gb, 1 * gb, 100, 0),
        (0.50, 2 * gb, 1.5 * gb, 2 * gb, 400, 0),
        (1.00, 3 * gb, 0.2 * gb, 3 * gb, 1_400, 1),
        (1.25, 1 * gb, 0.1 * gb, 3 * gb, 1_500, 2),
    ]
    rows = windows(trace, 0.5)
    assert [row[0] for row in rows] == ["0", "1"]
    assert rows[0][1:] == ["1.00 to 2.00", "0.50 to 1.50", "1.00 to 2.00", "300", "0"]
    # the second window's faults count from the first window's last reading
    assert rows[1][1:] == ["1.00 to 3.00", "0.10 to 0.20", "3.00 to 3.00", "1,100", "2"]


def fake_trainer(gate, seconds: float, matrix: int = 0, steps: int | None = None, then: str = "") -> str:
    """A side for run_in_turns, in its own process: each step sleeps ``seconds`` (and multiplies two
    ``matrix``-square matrices), for ``steps`` steps (the gate's count by default); ``then`` "raise" or "die"
    ends it so after its first step."""
    gate.begin()
    for _ in range(gate.steps if steps is None else steps):
        time.sleep(seconds)
        if matrix:
            torch.ones(matrix, matrix) @ torch.ones(matrix, matrix)
        gate.step_ended()
        if then == "raise":
            raise ValueError("out of data")
        if then == "die":
            os.kill(os.getpid(), 9)
    return f"slept {seconds}"


def test_interleaved_sides_alternate_steps_each_in_its_own_process_and_time_each_step_alone():
    """ours, trl, ours, trl, ...: a step's time is its own, not the other side's sleep between its steps;
    what a trainer returns comes back with its times."""
    results, order = run_in_turns(
        {"ours": (fake_trainer, (0.01,)), "trl": (fake_trainer, (0.12,))}, steps=4, interleaved=True
    )
    assert order == ["ours", "trl"] * 4
    assert all(0.01 <= s < 0.1 for s in results["ours"].seconds), results["ours"].seconds
    assert all(s >= 0.12 for s in results["trl"].seconds)
    assert results["trl"].extra == "slept 0.12" and results["ours"].profile is None
    faults, system, given_back = median_usage(results["ours"].usage)
    assert faults >= 0 and system >= 0 and given_back == 0


def test_by_default_sides_run_one_to_its_end_then_the_other():
    _, order = run_in_turns({"ours": (fake_trainer, (0.0,)), "trl": (fake_trainer, (0.0,))}, steps=3)
    assert order == ["ours"] * 3 + ["trl"] * 3


@pytest.mark.parametrize(
    "then, error",
    [
        ("raise", "the trl side of the benchmark failed:(.|\n)*ValueError: out of data"),
        ("die", "the trl side's process ended without a word \\(exit code -9"),
    ],
)
def test_a_side_that_fails_or_dies_stops_the_run_naming_it(then, error):
    with pytest.raises(RuntimeError, match=error):
        run_in_turns(
            {"ours": (fake_trainer, (0.0,)), "trl": (fake_trainer, (0.0, 0, None, then))}, steps=3, interleaved=True
        )


def test_a_trainer_that_stops_short_of_its_steps_is_an_error():
    with pytest.raises(RuntimeError, match="it ran 2 steps, not 3"):
        run_in_turns({"ours": (fake_trainer, (0.0, 0, 2))}, steps=3)


def test_the_profiled_step_is_the_one_numbered():
    """profile_step counts from 1; the profile (of that step's products only) comes back from each process."""
    results, _ = run_in_turns(
        {"small": (fake_trainer, (0.0, 16)), "large": (fake_trainer, (0.0, 64))},
        steps=3,
        profile_step=2,
        interleaved=True,
    )
    assert results["small"].profile.matmul_flops == 2 * 16**3
    assert results["large"].profile.matmul_flops == 2 * 64**3


def test_the_profiled_steps_run_under_the_profile_kind_asked_for_and_read_as_a_step_s_mean():
    """profile_steps from profile_step: steps 2 and 3 of 4 under an OpTimeProfile, whose products are a
    step's (2 n^3), not the sum of the two steps'."""
    results, _ = run_in_turns(
        {"ours": (fake_trainer, (0.0, 32))}, steps=4, profile_step=2, profile_steps=2, profile_kind=OpTimeProfile
    )
    profile = results["ours"].profile
    assert isinstance(profile, OpTimeProfile) and profile.steps == 2
    assert profile.matmul_flops == 2 * 32**3


def run_bench(script: str, arguments: list[str], tmp_path: Path) -> tuple[str, str]:
    """A benchmark script run as `make bench` runs it, its model cached under ``tmp_path``: (report, stderr)."""
    report = tmp_path / f"{script}.md"
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / script), *arguments]
        + ["--markdown", "--output", str(report)],
        env={**os.environ, "RLHF_BENCH_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return report.read_text(), done.stderr


def test_the_ppo_bench_runs_each_side_in_its_own_process_in_turns(tmp_path):
    """The PPO bench on the tiny model, two sides interleaved an update at a time: each side's records
    (phases, FLOPs, faults) come back from its process, and the report names the order and the steal."""
    text, stderr = run_bench(
        "ppo_throughput.py",
        ["--tiny", "--updates", "1", "--batch", "8", "--microbatch", "8", "--only", "shared", "--only", "trl"]
        + ["--order", "interleaved"],
        tmp_path,
    )
    assert "| rlhf_pipeline PPOTrainer, value_model shared (reference)" in text
    assert "| TRL 1.12 experimental PPOTrainer" in text and "AdamW" in text
    assert "order: interleaved; each side in a process of its own" in text and "(steal, /proc/stat)" in text
    assert len([line for line in stderr.splitlines() if "update times" in line]) == 2


def test_the_reward_bench_takes_turns_with_trl_s_trainer_end_to_end(tmp_path):
    """The reward bench on the tiny model, as `make bench` runs it but for two timed steps, TRL's side first, the
    mirrored order and one more step under the op clock in the first pass: both sides ran their steps through
    their callbacks (TRL's max_steps the gate's count), each run in its own process, TRL's, ours, ours, TRL's;
    the report says so, still lists ours first and has each side's profiled step."""
    arguments = ["--tiny", "--steps", "2", "--first", "trl", "--order", "mirrored", "--profile", "ops"]
    text, stderr = run_bench("reward_throughput.py", arguments, tmp_path)
    assert text.index("| rlhf_pipeline train_reward_model") < text.index("| TRL 1.12 RewardTrainer")  # ours' row first
    assert "order: mirrored, all of TRL's, then all of ours, then all of ours again and all of TRL's again" in text
    assert re.search(r"TRL's median step over ours, each pass: \d+\.\d\dx, \d+\.\d\dx\.", text)
    assert "1 warmup step + 2 timed steps per side and run, 2 runs a side" in text
    times = [line for line in stderr.splitlines() if "step times" in line]
    assert [line.split()[1] for line in times] == ["trl", "ours", "ours", "trl"], times
    # 4 steps in each first-pass run (warm-up, 2 timed, profiled), 3 in the second pass's (no profiled step)
    assert [line.count(",") for line in times] == [3, 3, 2, 2], times
    profiled = text.split("Where one more step's time goes (aten ops timed one by one", 1)[1]
    assert "| rlhf_pipeline train_reward_model |" in profiled and "| TRL 1.12 RewardTrainer |" in profiled
    assert "largest other ops (by name), ours: aten::" in text
    assert "profile: one step per side after the timed ones of the first pass, each aten op timed" in text


def test_the_reward_bench_s_order_note_says_how_the_steps_ran_and_each_mirrored_pass_s_ratio():
    """Sequential: one pass, the first side named first; mirrored: TRL's median timed step over ours in
    each pass (the warm-up step, first, left out)."""
    passes = [
        {"ours": [9.0, 1.0, 2.0, 3.0], "trl": [9.0, 3.0, 3.0, 3.0]},
        {"trl": [9.0, 4.0, 4.0], "ours": [9.0, 2.0, 2.0]},
    ]
    assert reward_throughput.order_note("sequential", passes[:1], 3, "trl").startswith(
        "order: sequential, all of TRL's and then all of ours;"
    )
    assert reward_throughput.order_note("mirrored", passes, 2, "ours").endswith("each pass: 2.00x, 2.00x.")
    assert reward_throughput.order_note("mirrored", passes, 3, "ours").endswith("each pass: 1.50x, 2.00x.")


def test_the_hypervisor_s_steal_is_its_share_of_the_cpu_time_over_the_timed_steps():
    """usage_now() tuples end with the machine's stolen and total CPU ticks; the share sums the spans."""
    spans = [((0, 0.0, 0, 100, 1000), (5, 0.1, 0, 130, 1200)), ((5, 0.1, 0, 200, 2000), (9, 0.2, 0, 250, 2300))]
    assert steal_share(spans) == pytest.approx(80 / 500)
    assert "ours 16%; trl n/a" in steal_note({"ours": spans, "trl": [((0, 0, 0, 0, 0), (0, 0, 0, 0, 0))]})
    assert "not counted" in steal_note({"ours": [((0, 0, 0, 0, 0), (0, 0, 0, 0, 0))]})
    first = cpu_ticks()
    time.sleep(0.05)
    second = cpu_ticks()
    if Path("/proc/stat").is_file():
        assert 0 <= first[0] <= second[0] <= second[1] and first[1] < second[1]


def test_the_process_start_bench_s_reference_keeps_the_collector_on(tmp_path):
    """bench/process_start.py compares the stages' collector with one left on: through its wrapper, a
    script whose first import is stages/_interpreter.py finds the collector off as shipped and on in
    the reference, and gets the --help the bench asks for."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "_interpreter.py").write_bytes((repo / "stages" / "_interpreter.py").read_bytes())
    probe = "import sys\nimport _interpreter\nimport gc\nprint(gc.isenabled(), sys.argv[1:])\n"
    (tmp_path / "scripts" / "probe.py").write_text(probe)
    seen = {}
    for collector in ("shipped", "on"):
        ran = subprocess.run(
            [sys.executable, "-c", WRAPPER, "scripts/probe.py", collector],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        seen[collector] = ran.stdout.strip()
    assert seen == {"shipped": "False ['--help']", "on": "True ['--help']"}
