"""Prefect flow that retrains the RLHF pipeline: bring in labels, `dvc repro` stage by stage, commit, gate, push.

Run once (against ``PREFECT_API_URL`` if set, else a temporary local server)::

    python -m flows.retrain [--repo .] [--incoming PATH] [--remote NAME] [--no-push]

Serve the weekly schedule (needs a running server, see ``server`` below)::

    python -m flows.retrain server                       # = prefect server start --host 127.0.0.1
    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.retrain serve [--cron "0 3 * * 1"]

What a run does, in order:

1. Takes the retrain lock ``.dvc/tmp/retrain.lock`` (a file lock, so it needs no server and also
   guards runs started from the command line). An overlapping run waits up to ``lock_timeout``
   seconds, then fails with a clear message; it never touches the workspace while another run
   holds the lock. The served deployment additionally has a Prefect deployment concurrency limit
   of 1 (collision strategy ENQUEUE), so scheduled runs queue on the server instead of piling up
   on the lock. DVC's own repo lock stays the last line of defence against a manual ``dvc repro``:
   a stage that hits it fails with exit 1 and is retried with backoff.
2. Checks the whole params.yaml (``rlhf check-params``): a bad key stops the run before any stage.
3. Brings in labels as ``labelling.source`` says (:mod:`.labels`). The labels are one file,
   ``data.preferences.source``. ``simulated``: none (an ``incoming`` file is refused, exit 2).
   ``file``: ``incoming`` (a file, or a folder whose newest ``.jsonl``/``.parquet`` is taken) is
   copied privately and validated; on failure the flow fails with the validator's summary and
   nothing is replaced, on success the validated copy is renamed over the labels file and
   ``dvc add``-ed. ``label_studio``: ``labelling.label_studio_project``'s annotations are pulled
   from the server at ``$LABEL_STUDIO_URL`` (``rlhf label import --from-server``, retried like a
   stage), added to a private copy of the labels file (every round kept, deduplicated by task and
   annotator) and that copy is ingested the same way.
4. DVC's status (``Repo.status``): when nothing is stale no stage runs ("all stages up to date").
5. Each stage, in the order of DVC's stage graph (dependencies first; ``dvc.yaml`` order among
   independent stages), is one task running ``dvc repro --single-item STAGE``: DVC re-runs the
   stage only if it is stale, and never recurses into upstream stages
   (they ran, or were checked, just before). Exit codes of the stage command (DVC reports
   "exited with N"): the codes of ``rlhf_pipeline.errors.NOT_RETRIED_EXIT_CODES`` (2 params, 3 data
   contract, 4 non-finite training, 5 an output not writable, 6 a missing package, 127 a missing
   command) are not retried, the flow fails at once with the stage's message; anything else is
   retried with exponential backoff. Each stage runs with the flow's own interpreter first on
   ``PATH``, so ``.venv/bin/python -m flows.retrain`` needs no activated venv.
6. Where the project declares a policy artifact: commits the run's record (dvc.lock, metrics/,
   evaluation/, the .dvc files; a registry version is a commit), then the promotion gate
   (``rlhf models gate``) registers the new policy and assigns it prod only if ``promotion.*``
   holds; its decision is a markdown artifact. With ``promotion.score: human`` the gate may wait
   (:mod:`.rounds`): after it, the run samples the challenger's side-by-side round and sends it to
   ``promotion.human.label_studio_project`` (``rlhf label compare --send``) and ends; before the gate of
   a later run, the answers are pulled (``rlhf label verdicts --from-server``), and the gate decides.
7. Re-reads every output against dvc.lock and the DVC cache, then ``dvc push`` (to ``remote`` if
   given, else the default remote, else ``localremote``), then a markdown summary artifact (stages,
   metrics against HEAD and against the previous run, lineage of the policy) and a table artifact
   of the metrics.

The package is split by concern: :mod:`.dvc_project` (everything asked of DVC), :mod:`.report`
(the summary artifacts), :mod:`.labels` (the label tasks), :mod:`.rounds` (the side-by-side round
tasks around the gate), :mod:`.flow` (the stage, commit, gate and
push tasks, the flow, the deployment), :mod:`.pool` (the work pool and its crash automations),
``__main__`` (the CLI).
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline env vars and PREFECT_HOME before Prefect loads)

from flows.retrain.dvc_project import CommandResult, stage_exit_code, stage_order
from flows.retrain.flow import DEPLOYMENT_NAME, build_deployment, resolve_schedule, retrain

__all__ = [
    "DEPLOYMENT_NAME",
    "CommandResult",
    "build_deployment",
    "resolve_schedule",
    "retrain",
    "stage_exit_code",
    "stage_order",
]
