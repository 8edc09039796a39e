"""The flow's side-by-side tasks (``promotion.score: human`` with ``promotion.human.label_studio_project``):
the work a human decision waits on, around the gate, which only reads the round and decides.

Before the gate, a challenger an earlier run registered and whose round was sent has its answers
pulled (`rlhf label verdicts --from-server`). After a gate that waits for a round not yet sampled,
the round is sampled and sent (`rlhf label compare --send`), and its file committed. Both are the
commands a person runs, as subprocesses, so that torch loads in them and not in the flow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff

from flows.retrain.dvc_project import refuse_retry_on_contract_errors, run_rlhf
from rlhf_pipeline.gate import waiting_round
from rlhf_pipeline.params.schema import load_params
from rlhf_pipeline.side_by_side import commit_round, load_round, round_path

ROUND_TIMEOUT_SECONDS = 3600  # sampling both models on the held-out queries


@task(
    name="pull-verdicts",
    retries=2,
    retry_delay_seconds=exponential_backoff(10),
    retry_condition_fn=refuse_retry_on_contract_errors,
    cache_policy=NO_CACHE,
)
def pull_verdicts(repo: str, project: int) -> str:
    """People's answers in Label Studio project ``project`` into their rounds' files."""
    output = run_rlhf(
        Path(repo), ["label", "verdicts", "--from-server", str(project)], f"pulling project {project}'s verdicts"
    )
    get_run_logger().info("side-by-side verdicts pulled from project %d:\n%s", project, output)
    return output


@task(name="send-round", cache_policy=NO_CACHE)
def send_round(repo: str, challenger: str, incumbent: str, project: int) -> str:
    """The round of ``challenger`` against ``incumbent`` sampled, sent to ``project`` and committed."""
    root = Path(repo)
    args = ["label", "compare", challenger, incumbent, "--send", str(project)]
    run_rlhf(root, args, f"sending the round of {challenger} against {incumbent}", timeout=ROUND_TIMEOUT_SECONDS)
    path = round_path(root, challenger, incumbent)
    commit_round(root, path)
    return f"{len(load_round(path, root).order)} tasks sent to Label Studio project {project}"


def pull_before_gate(root: Path) -> dict[str, Any]:
    """The answers to the round HEAD's registered policy waits for, pulled where its tasks were sent."""
    params_file = root / "params.yaml"
    wanted = waiting_round(root, load_params(params_file)) if params_file.is_file() else None
    if wanted is None or wanted.project is None or not wanted.sampled:
        return {}
    return {"verdicts": pull_verdicts(str(root), wanted.project)}


def send_after_gate(root: Path, decision: dict[str, Any]) -> str:
    """The gate's outcome, and where a round it waits for went when the flow sent it."""
    wanted = decision.get("round") or {}
    if not decision.get("waiting") or wanted.get("sampled") or wanted.get("project") is None:
        return decision["outcome"]
    sent = send_round(str(root), wanted["challenger"], wanted["incumbent"], wanted["project"])
    return f"{wanted['challenger']} is registered and waits for people's side-by-side verdicts: {sent}"
