"""``python -m flows.retrain [run|serve|deploy|server]``: one retrain run, the weekly schedule served from
this process or deployed to a work pool, or a Prefect server."""

from __future__ import annotations

import argparse
import os
import sys

from flows.retrain.defaults import (
    CRASH_RESTARTS,
    FEWEST_HEARTBEAT_SECONDS,
    FEWEST_MISSED_HEARTBEATS,
    HEARTBEAT_SECONDS,
    LOCK_TIMEOUT_SECONDS,
    MISSED_HEARTBEATS,
    RETRIES,
    RETRY_DELAY_SECONDS,
)
from flows.retrain.flow import DEPLOYMENT_NAME, build_deployment, retrain
from flows.retrain.pool import deploy_to_pool
from rlhf_pipeline.arguments import seconds, whole_number
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.runner import report_error


def _api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _start_server(argv: list[str]) -> None:
    """``server``: this process becomes ``prefect server start`` on 127.0.0.1 (never returns)."""
    parser = argparse.ArgumentParser(prog="python -m flows.retrain server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="4200")
    args = parser.parse_args(argv)
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", args.host, "--port", str(args.port)]
    print(
        f"PREFECT_HOME={os.environ['PREFECT_HOME']}; then export PREFECT_API_URL=http://{args.host}:{args.port}/api",
        flush=True,
    )
    os.execv(sys.executable, cmd)


def _parser(command: str) -> argparse.ArgumentParser:
    """The options of ``run``, ``serve`` and ``deploy``: the run's own, then the schedule's, then the pool's."""
    parser = argparse.ArgumentParser(prog=f"python -m flows.retrain {command}")
    parser.add_argument("--repo", default=".")
    parser.add_argument(
        "--incoming", default=None, help="labels file, or folder (newest .jsonl/.parquet); labelling.source: file"
    )
    parser.add_argument(
        "--remote", default=None, help="DVC remote to push to (default: default remote, else localremote)"
    )
    parser.add_argument("--no-push", dest="push", action="store_false")
    if command == "run":
        parser.add_argument("--retries", type=whole_number(0), default=RETRIES)
        parser.add_argument(
            "--retry-delay", type=seconds, default=RETRY_DELAY_SECONDS, help="first retry delay in seconds, doubling"
        )
        parser.add_argument("--lock-timeout", type=seconds, default=LOCK_TIMEOUT_SECONDS)
        return parser
    parser.add_argument("--cron", default=None, help="default: params.yaml schedule.cron")
    parser.add_argument(
        "--timezone", default=None, help="IANA time zone of the cron (default: params.yaml schedule.timezone)"
    )
    if command == "deploy":
        parser.add_argument("--pool", required=True, help="process work pool (made when missing)")
        parser.add_argument(
            "--heartbeat-seconds",
            type=whole_number(FEWEST_HEARTBEAT_SECONDS),
            default=HEARTBEAT_SECONDS,
            help=f">= {FEWEST_HEARTBEAT_SECONDS}; a run silent --missed-heartbeats x this is Crashed",
        )
        parser.add_argument(
            "--missed-heartbeats",
            type=whole_number(FEWEST_MISSED_HEARTBEATS),
            default=MISSED_HEARTBEATS,
            help=f">= {FEWEST_MISSED_HEARTBEATS}; heartbeats a run may miss before it is Crashed",
        )
        parser.add_argument(
            "--crash-restarts",
            type=whole_number(0),
            default=CRASH_RESTARTS,
            help="times a crashed run is scheduled again",
        )
    return parser


def _deploy(args: argparse.Namespace) -> int:
    try:
        ids = deploy_to_pool(
            args.pool,
            args.repo,
            args.cron,
            args.timezone,
            args.incoming,
            args.remote,
            args.push,
            args.heartbeat_seconds,
            args.crash_restarts,
            args.missed_heartbeats,
        )
    except PipelineError as error:
        return report_error(error, "python -m flows.retrain deploy")
    print(
        f"deployment retrain/{DEPLOYMENT_NAME} ({ids['deployment_id']}) on work pool {args.pool}; start a worker: "
        f"prefect worker start --pool {args.pool}"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from prefect import serve

    try:
        deployment = build_deployment(args.repo, args.cron, args.timezone, args.incoming, args.remote, args.push)
    except PipelineError as error:
        return report_error(error, "python -m flows.retrain serve")
    serve(deployment)
    return 0


def _run(args: argparse.Namespace) -> int:
    state = retrain(
        repo=args.repo,
        incoming=args.incoming,
        remote=args.remote,
        push=args.push,
        retries=args.retries,
        retry_delay_seconds=args.retry_delay,
        lock_timeout=args.lock_timeout,
        return_state=True,
    )
    if state.is_completed():
        report = state.result()
        print(report["status"] + (f"\npromotion gate: {report['promotion']}" if report.get("promotion") else ""))
        return 0
    error = state.result(raise_on_failure=False)
    print(f"retrain failed: {error if isinstance(error, BaseException) else state.message}", file=sys.stderr)
    return getattr(error, "exit_code", PipelineError.exit_code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in {"run", "serve", "deploy", "server"} else "run"
    if command == "server":
        _start_server(argv)
    args = _parser(command).parse_args(argv)
    if command in ("serve", "deploy") and not _api_url():
        print(
            f"{command} needs a Prefect server: start one with `python -m flows.retrain server` and "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api",
            file=sys.stderr,
        )
        return 2
    return {"deploy": _deploy, "serve": _serve, "run": _run}[command](args)


if __name__ == "__main__":
    sys.exit(main())
