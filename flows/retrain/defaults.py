"""The retrain run's defaults, one home for each: the flow's signature, its tasks' decorators, the
work pool's deployment and ``python -m flows.retrain``'s options all read them from here."""

from __future__ import annotations

RETRIES = 3  # of a stage, a label pull or a push that failed with a retryable exit code
RETRY_DELAY_SECONDS = 30.0  # the first retry's; it doubles with each retry
LOCK_TIMEOUT_SECONDS = 3600.0  # how long a run waits for an overlapping one to finish
CRASH_RESTARTS = 2  # times a crashed deployed run is scheduled again before the flow refuses it
HEARTBEAT_SECONDS = 60  # a deployed run's heartbeat interval
FEWEST_HEARTBEAT_SECONDS = 30  # Prefect's PREFECT_FLOWS_HEARTBEAT_FREQUENCY minimum
# A run is taken for dead after this many heartbeats did not arrive. At least 2: with a window of one
# interval, a live run's heartbeat sent a moment late would land after the window closed.
MISSED_HEARTBEATS = 3
FEWEST_MISSED_HEARTBEATS = 2
