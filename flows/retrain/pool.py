"""The retrain deployment on a Prefect work pool, for a server and workers that outlive one process.

``serve`` runs the schedule inside its own process; here the deployment lives on the server, and any
``prefect worker start --pool NAME`` (on this machine or another that sees the same project folder)
picks its runs up. Besides the deployment (the cron of ``params.yaml``, concurrency limit 1 with
queued collisions), two automations make a run that dies with its machine come back:

1. **Crashed when silent.** A run sends a heartbeat every ``heartbeat_seconds``
   (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` in the run's environment); when neither a heartbeat nor a
   final state follows within ``missed_heartbeats * heartbeat_seconds`` (3 × 60 s unless deployed
   otherwise), the run is marked Crashed (Prefect's
   zombie-flow recipe). A worker watches the runs it starts, but a worker killed with its run
   watches nothing.
2. **Crashed, then scheduled again.** A Crashed run of this deployment is set back to Scheduled
   ("AwaitingRetry"); a worker picks it up and the flow reruns it: DVC reproduces what the dead run
   left stale, and the retrain lock, ``dvc.lock`` and DVC's rwlock were all left recoverable. The
   flow refuses (Failed, which no automation retries) a run that has already crashed
   ``crash_restarts`` times, so a run that always kills its machine stops coming back.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectNotFound
from prefect.schedules import Cron

from flows.retrain.defaults import (
    CRASH_RESTARTS,
    FEWEST_HEARTBEAT_SECONDS,
    FEWEST_MISSED_HEARTBEATS,
    HEARTBEAT_SECONDS,
    MISSED_HEARTBEATS,
)
from flows.retrain.flow import (
    CODE_ROOT,
    DEPLOYMENT_NAME,
    deployment_parameters,
    resolve_schedule,
    retrain,
    running_code_commit,
)
from rlhf_pipeline.errors import PipelineError

ENTRYPOINT = "flows/retrain/flow.py:retrain"
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"


def ensure_process_pool(name: str) -> None:
    """The work pool ``name`` (type process), made when the server has none of that name."""
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def _automation(name: str, trigger: EventTrigger, action: ChangeFlowRunState) -> Automation:
    """Create the automation ``name`` afresh (a redeploy replaces the old one instead of adding one)."""
    try:
        Automation.read(name=name).delete()
    except ValueError:  # none of that name yet
        pass
    return Automation(name=name, trigger=trigger, actions=[action]).create()


def crash_automations(
    deployment_id: UUID, heartbeat_seconds: int, missed_heartbeats: int = MISSED_HEARTBEATS
) -> list[Automation]:
    """The two automations of the module docstring, for the runs of ``deployment_id`` only."""
    silent_seconds = missed_heartbeats * heartbeat_seconds
    of_deployment = ResourceSpecification(
        {"prefect.resource.id": f"prefect.deployment.{deployment_id}", "prefect.resource.role": "deployment"}
    )
    runs = ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"})
    silent = EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect={
            "prefect.flow-run.heartbeat",
            "prefect.flow-run.Completed",
            "prefect.flow-run.Failed",
            "prefect.flow-run.Cancelled",
            "prefect.flow-run.Crashed",
        },
        match=runs,
        match_related=of_deployment,
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=silent_seconds),
    )
    crashed = EventTrigger(
        expect={"prefect.flow-run.Crashed"},
        match=runs,
        match_related=of_deployment,
        for_each={"prefect.resource.id"},
        posture=Posture.Reactive,
        threshold=1,
    )
    return [
        _automation(
            f"{DEPLOYMENT_NAME}: crashed when silent",
            silent,
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {silent_seconds} s: its process or machine died",
            ),
        ),
        _automation(
            f"{DEPLOYMENT_NAME}: retry when crashed",
            crashed,
            ChangeFlowRunState(
                state=StateType.SCHEDULED,
                name="AwaitingRetry",
                message="crashed: scheduled again (the flow refuses it after its crash_restarts)",
                force=True,  # Crashed is final: only a forced transition leaves it
            ),
        ),
    ]


def deploy_to_pool(
    pool: str,
    repo: str | Path = ".",
    cron: str | None = None,
    timezone: str | None = None,
    incoming: str | None = None,
    remote: str | None = None,
    push: bool = True,
    heartbeat_seconds: int = HEARTBEAT_SECONDS,
    crash_restarts: int = CRASH_RESTARTS,
    missed_heartbeats: int = MISSED_HEARTBEATS,
) -> dict[str, Any]:
    """The ``retrain-schedule`` deployment of the DVC project ``repo`` on the process work pool ``pool``
    (made if missing), and the crash automations. The worker loads the flow from this checkout
    (:data:`CODE_ROOT`, usually ``repo`` itself) and runs it in ``repo``. Returns the ids."""
    too_short = heartbeat_seconds < FEWEST_HEARTBEAT_SECONDS or missed_heartbeats < FEWEST_MISSED_HEARTBEATS
    if too_short or crash_restarts < 0:
        raise PipelineError(
            f"heartbeat_seconds must be at least {FEWEST_HEARTBEAT_SECONDS} (Prefect's "
            f"PREFECT_FLOWS_HEARTBEAT_FREQUENCY minimum; got {heartbeat_seconds}), crash_restarts at least 0 (got "
            f"{crash_restarts}) and missed_heartbeats at "
            f"least {FEWEST_MISSED_HEARTBEATS} (got {missed_heartbeats})."
        )
    root = Path(repo).expanduser().resolve()
    schedule = resolve_schedule(root, cron, timezone)  # validates all of params.yaml: refused before deploying
    ensure_process_pool(pool)
    parameters = deployment_parameters(root, incoming, remote, push) | {
        "crash_restarts": crash_restarts,
        "code_commit": running_code_commit(),  # a worker whose checkout is at another commit refuses the run
    }
    deployment_id = retrain.from_source(source=str(CODE_ROOT), entrypoint=ENTRYPOINT).deploy(
        name=DEPLOYMENT_NAME,
        work_pool_name=pool,
        schedules=[Cron(schedule.cron, timezone=schedule.timezone)],
        parameters=parameters,
        concurrency_limit=1,  # collision strategy ENQUEUE: an overlapping run waits for the slot
        job_variables={"env": {HEARTBEAT_ENV: str(heartbeat_seconds)}, "working_dir": str(root)},
        tags=["rlhf", "retrain"],
        description="RLHF retrain: ingest, dvc repro (stale stages only), push, report; run by a process worker.",
        build=False,
        push=False,
        print_next_steps=False,
    )
    automations = crash_automations(deployment_id, heartbeat_seconds, missed_heartbeats)
    return {"deployment_id": str(deployment_id), "pool": pool, "automations": [str(a.id) for a in automations]}
