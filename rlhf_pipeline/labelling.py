"""People label: Label Studio tasks out, annotations in, as OpenAI's lm-human-preferences collected
them (a query, N responses sampled from the current model, the labeller picks the best of N).

- :func:`label_config` is the labelling interface (Label Studio XML): the query, the N responses,
  one required single choice whose exported value is the response's index.
- :func:`rlhf_pipeline.label_tasks.export_tasks` samples the tasks from a model; each carries what ties
  it back (:data:`TASK_FIELDS`), ``task_id`` a hash of them (:func:`task_id`). It lives apart because it
  loads torch and transformers, which reading an export (`rlhf label import`, 48 times in the test suite)
  does not need: 2.8 s of CPU a command with them, 0.8 s without.
- :func:`fetch_export` pulls a project's JSON export from a running server (its address and API token
  from the environment, as Label Studio's own SDK reads them: never from params or files in git).
- :func:`rows_from_export` reads Label Studio's JSON export into best-of-N preference rows, one per
  annotation, with ``annotator``, ``task_id``, ``round`` and ``model``; it refuses
  (:class:`DataContractError`, exit 3, nothing written) an annotation that cannot be a label and
  reports cancelled and skipped ones, and the agreement between annotators where a task has several.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from xml.sax.saxutils import quoteattr

from rlhf_pipeline.errors import DataContractError, PipelineError, SettingsError, plain, quoted
from rlhf_pipeline.io import UTF8_OPTIONAL_BOM, read_jsonl, sha256_file
from rlhf_pipeline.json_stream import iter_json_array
from rlhf_pipeline.params.labelling import LabellingParams
from rlhf_pipeline.text_rules import INVISIBLE_CHARACTERS, text_problem
from rlhf_pipeline.project_key import pseudonym
from rlhf_pipeline.redaction import header_safe, redact, remember, shown_url

CHOICE = "best"  # the <Choices> name: what an annotation's result is read from
URL_VARIABLE, TOKEN_VARIABLE = "LABEL_STUDIO_URL", "LABEL_STUDIO_API_KEY"  # the names Label Studio's SDK reads
TASK_FIELDS = ("task_id", "query", "split", "query_index", "seed", "model", "model_sha256", "round")


def label_config(n: int) -> str:
    """Label Studio's labelling interface for best-of-``n`` (n = 2: pairwise): the query, each response
    under its number, and one required choice whose value (its ``alias``) is the response's index."""
    if n < 2:
        raise PipelineError(f"a labelling task needs at least 2 responses to choose from (got {n}).")
    lines = [
        "<View>",
        '  <Header value="Query"/>',
        '  <Text name="query" value="$query"/>',
        f'  <Header value="Which response continues it best? Pick one of the {n}."/>',
    ]
    for i in range(n):
        lines += [f'  <Header value="Response {i + 1}" size="5"/>', f'  <Text name="sample{i}" value="$sample{i}"/>']
    lines.append(f'  <Choices name="{CHOICE}" toName="query" choice="single" required="true" showInLine="true">')
    for i in range(n):
        lines.append(f"    <Choice value={quoteattr(f'Response {i + 1}')} alias={quoteattr(str(i))}/>")
    lines += ["  </Choices>", "</View>", ""]
    return "\n".join(lines)


def task_id(model_sha256: str, split: str, query_index: int, seed: int, n: int, round_: int) -> str:
    """The id that ties a task to what made it: the same inputs give the same id (deduplication)."""
    key = json.dumps([model_sha256, split, query_index, seed, n, round_])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 of the model's weight files, in name order (which weights sampled the responses)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{model_dir}: no *.safetensors weights; give a model folder (models/base, models/policy).")
    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_SHOWN_BODY = 4096  # bytes of an error answer read to show its start (redacted first, then cut to 300 characters)
_SPOOL_IN_MEMORY = 8 << 20  # an answer larger than this is spooled to a temporary file, not held in memory


def server_address(environ: dict[str, str], limits: LabellingParams) -> str:
    """``$LABEL_STUDIO_URL`` without its trailing slash, when a token may be sent there: https, or http
    to this machine, or http elsewhere where ``labelling.allow_plain_http`` says so; else SettingsError."""
    from urllib.parse import urlsplit

    base = environ[URL_VARIABLE].strip().rstrip("/")
    try:
        parts = urlsplit(base)
        host = (parts.hostname or "").lower()
        parts.port  # noqa: B018  (a port that is not a number raises here, not in the HTTP library)
    except ValueError:
        parts, host = None, ""
    if parts is None or parts.scheme not in ("http", "https") or not host or "@" in parts.netloc:
        raise SettingsError(
            f"{URL_VARIABLE} is {quoted(shown_url(base))}: give the server's address as http(s)://HOST[:PORT], "
            "without a user or password (the token goes in " + TOKEN_VARIABLE + "; what stood before an @ is not "
            "shown). Nothing was sent."
        )
    if (
        parts.scheme == "http"
        and not (host in LOOPBACK_HOSTS or host.startswith("127."))
        and not limits.allow_plain_http
    ):
        raise SettingsError(
            f"{URL_VARIABLE} is {quoted(shown_url(base))}: plain http:// to another machine would send the API token "
            "in clear. "
            "Use https://, or set labelling.allow_plain_http: true on a network you trust. Nothing was sent."
        )
    return base


def server_credentials(environ: dict[str, str], limits: LabellingParams, doing: str) -> tuple[str, str]:
    """(the server's address, the API token), from the environment as Label Studio's own SDK reads them,
    for ``doing`` (named in the message when one is missing); the address as :func:`server_address` allows."""
    missing = [name for name in (URL_VARIABLE, TOKEN_VARIABLE) if not environ.get(name)]
    if missing:
        raise SettingsError(
            f"{doing} reads the server's address and your API token from the environment; "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Export {URL_VARIABLE}="
            f"http://HOST:PORT and {TOKEN_VARIABLE}=<the token on Label Studio's Account & Settings page>; they are "
            "never read from params or files, so they stay out of git."
        )
    token = environ[TOKEN_VARIABLE].strip()
    remember(token)  # redacted from every message from now on, even where ``environ`` is not the process's
    if not header_safe(token):
        raise SettingsError(
            f"{TOKEN_VARIABLE} holds a character an HTTP header cannot carry (a space, a line break, a control "
            "character or a letter outside ASCII: a paste gone wrong?). Copy the token again from Label Studio's "
            "Account & Settings page; it is not shown here. Nothing was sent."
        )
    return server_address(environ, limits), token


def fetch_export(
    project: int,
    limits: LabellingParams,
    environ: dict[str, str] | None = None,
    doing: str = "rlhf label import --from-server",
):
    """(project ``project``'s annotated tasks as Label Studio's JSON export, a name for messages): a
    text file positioned at its start, pulled from the server at ``$LABEL_STUDIO_URL`` with the API
    token ``$LABEL_STUDIO_API_KEY`` (read it with :func:`read_export`).

    With ``httpx`` (already a dependency) rather than Label Studio's SDK, whose closure would move the
    pipeline's lock for this one call. The token is either kind Label Studio's Account & Settings page
    gives: a personal access token (a JWT refresh token, exchanged for an access token first) or a
    legacy token. It is never printed, never sent over plain http to another machine (unless
    ``limits.allow_plain_http``), and never sent on across a redirect: one is refused. The answer is
    read within ``limits.server_timeout_s`` (the whole exchange, a server that trickles included) and
    up to ``limits.max_export_mb``."""
    base, token = server_credentials(os.environ if environ is None else environ, limits, doing)
    where = f"Label Studio project {project} at {base}"
    outcome: dict = {}
    stop = threading.Event()

    def work() -> None:
        try:
            outcome["file"] = _download(base, project, token, limits, where, stop)
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=work, name="label-studio-export", daemon=True)
    worker.start()
    worker.join(limits.server_timeout_s)
    if worker.is_alive():
        stop.set()  # the worker drops what it read at its next chunk
        raise PipelineError(  # exit 1: the retrain flow retries it (a server restarting, a slow network)
            f"{where} did not finish answering within labelling.server_timeout_s = {limits.server_timeout_s:g} s "
            "(the whole exchange). Try again, or raise the bound for a very large project; nothing written."
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["file"], where


def _download(base: str, project: int, token: str, limits: LabellingParams, where: str, stop: threading.Event):
    """The export, spooled to a temporary file within the size bound (see :func:`fetch_export`)."""
    import httpx

    refused = _refused(where)
    limit = limits.max_export_bytes
    try:
        # follow_redirects=False (httpx's default, stated): a redirect is refused below, never followed
        with httpx.Client(base_url=base, timeout=limits.server_timeout_s, follow_redirects=False) as client:
            authorization = _authorization(client, token, where)
            request = client.build_request(
                "GET",
                f"/api/projects/{project}/export",
                params={"exportType": "JSON", "download_all_tasks": "false"},
                headers={"Authorization": authorization},
            )
            response = client.send(request, stream=True)
            try:
                _check_status(response, where, refused)
                kind = response.headers.get("content-type", "")
                if "json" not in kind:
                    raise DataContractError(
                        f"{where} answered {quoted(kind) if kind else 'no content type'}, not JSON: "
                        f"{URL_VARIABLE} may point at another service (a proxy's page?). Nothing written."
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise _too_large(where, limits)
                spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY, mode="w+b")
                received = 0
                for chunk in response.iter_bytes():
                    received += len(chunk)
                    if received > limit:
                        spool.close()
                        raise _too_large(where, limits)
                    if stop.is_set():
                        spool.close()
                        return None
                    spool.write(chunk)
            finally:
                response.close()
    except httpx.HTTPError as error:
        raise PipelineError(  # exit 1: the retrain flow retries it (a server restarting)
            f"{where}: the server did not answer ({type(error).__name__}: {plain(redact(error), 300)}); nothing "
            "written."
        ) from None
    spool.seek(0)
    return io.TextIOWrapper(spool, encoding=UTF8_OPTIONAL_BOM, errors="replace")


def _refused(where: str) -> str:
    return (
        f"{where} refused the token in {TOKEN_VARIABLE} (HTTP {{}}): use a token from Label Studio's Account & "
        "Settings page (a personal access token, or a legacy token where the organisation enables them); "
        "nothing written."
    )


def _authorization(client, token: str, where: str) -> str:
    """The Authorization header for ``token``: a legacy token as it is, a personal access token (a JWT
    refresh token) exchanged for an access token first."""
    if token.count(".") != 2:
        return f"Token {token}"
    exchanged = client.post("/api/token/refresh", json={"refresh": token})
    _check_status(exchanged, where, _refused(where))
    try:
        access = exchanged.json()["access"]
    except (ValueError, KeyError, TypeError):
        access = None
    if not isinstance(access, str) or not header_safe(access):
        raise DataContractError(f"{where}: the token exchange answered no usable access token (it is not shown).")
    remember(access)  # a secret as much as the token it was exchanged for
    return f"Bearer {access}"


def send_tasks(project: int, tasks: list[dict], limits: LabellingParams, environ: dict[str, str] | None = None) -> int:
    """Import ``tasks`` into Label Studio project ``project`` (its address and token from the environment,
    as :func:`fetch_export` reads them, with the same refusals); how many the server took."""
    import httpx

    environ = os.environ if environ is None else environ
    base, token = server_credentials(environ, limits, f"sending tasks to Label Studio project {project}")
    where = f"Label Studio project {project} at {base}"
    try:
        with httpx.Client(base_url=base, timeout=limits.server_timeout_s, follow_redirects=False) as client:
            headers = {"Authorization": _authorization(client, token, where)}
            response = client.post(f"/api/projects/{project}/import", json=tasks, headers=headers)
            if response.status_code != 201:  # Label Studio answers an import with 201 Created
                _check_status(response, where, _refused(where))
            try:
                return int(response.json().get("task_count", len(tasks)))
            except (ValueError, TypeError, AttributeError):
                return len(tasks)
    except httpx.HTTPError as error:
        raise PipelineError(
            f"{where}: the server did not answer ({type(error).__name__}: {plain(redact(error), 300)}); no task was "
            "sent."
        ) from None


def _too_large(where: str, limits: LabellingParams) -> DataContractError:
    return DataContractError(
        f"{where}: the export is over labelling.max_export_mb = {limits.max_export_mb:g} MiB; reading stopped there. "
        "Export fewer tasks (one round at a time), or raise the bound. Nothing written."
    )


def _check_status(response, where: str, refused: str) -> None:
    """Refuse an answer that is not 200 OK: a redirect (never followed: the token stays here), a token
    refused, no such project, anything else (its first characters, every secret redacted first)."""
    status = response.status_code
    if 300 <= status < 400:
        location = response.headers.get("location")
        target = quoted(shown_url(location), 120) if location else "no Location"
        raise SettingsError(
            f"{where} answered a redirect (HTTP {status}) to {target} (its user, query and fragment not shown); it is "
            "not followed, so the token is not sent "
            f"there. Set {URL_VARIABLE} to the address that answers itself (https:// if the server redirects to it). "
            "Nothing written."
        )
    if status in (401, 403):
        raise SettingsError(refused.format(status))
    if status == 404:
        raise SettingsError(f"{where}: no such project (HTTP 404); its id is the number in the project's URL.")
    if status != 200:
        # redacted before it is cut: a secret the server echoes near the cut is not shown in part
        text = redact(response.read()[:_SHOWN_BODY].decode("utf-8", "replace"))
        raise PipelineError(f"{where} answered HTTP {status}: {quoted(text, 300)}; nothing written.")


def read_export(handle, where: str, limits: LabellingParams) -> Iterator[tuple[int, dict]]:
    """``(position, task)`` of a Label Studio JSON export (a text file), parsed one task at a time
    (:func:`rlhf_pipeline.json_stream.iter_json_array`): any size is read in bounded memory."""
    return iter_json_array(handle.read, where, max_element_chars=limits.max_export_bytes)


def open_export_file(path: str | Path, limits: LabellingParams):
    """A hand-made or downloaded export file, open as text; refused (exit 3) over the size bound."""
    try:
        size = Path(path).stat().st_size
        if size > limits.max_export_bytes:
            raise DataContractError(
                f"{path}: {size / (1 << 20):,.0f} MiB, over labelling.max_export_mb = {limits.max_export_mb:g} MiB. "
                "Import it round by round, or raise the bound; nothing written."
            )
        return open(path, encoding=UTF8_OPTIONAL_BOM, errors="replace")
    except OSError as error:
        raise DataContractError(f"{path}: not a readable Label Studio JSON export ({error.strerror}).") from None


@dataclass
class ImportReport:
    rows: list[dict]
    annotations: int = 0
    cancelled: int = 0
    skipped: int = 0  # submitted without a choice
    tasks: int = 0
    tasks_with_several: int = 0
    agreement: float | None = None  # share of annotator pairs on one task that chose the same response
    annotators: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        return {
            "rows": len(self.rows),
            "tasks": self.tasks,
            "annotations": self.annotations,
            "cancelled": self.cancelled,
            "skipped": self.skipped,
            "annotators": dict(sorted(self.annotators.items())),
            "tasks_with_several_annotations": self.tasks_with_several,
            "agreement": self.agreement,
        }


def annotation_author(annotation: dict, where: str) -> str:
    """The identity of the person who made ``annotation`` (an id or an e-mail address): read to be
    pseudonymised at once (:func:`answered_choice`), never written."""
    who = annotation.get("completed_by")
    if isinstance(who, dict):  # some exports expand the user: its id first, as a plain export gives it
        who = who.get("id") if who.get("id") is not None else who.get("email")
    if not isinstance(who, (str, int)) or isinstance(who, bool) or not str(who).isprintable() or len(str(who)) > 256:
        raise DataContractError(
            f"{where}: completed_by is {quoted(str(who))}, not an annotator's id or email; Label Studio writes one "
            "for every annotation. Nothing was written."
        )
    return str(who)


def annotation_choice(annotation: dict, where: str) -> list[str] | None:
    """The values chosen in ``annotation``'s result for :data:`CHOICE` (None: no choice made)."""
    result = annotation.get("result") or []
    if not isinstance(result, list):
        raise DataContractError(f"{where}: its result is not a list of regions. Nothing was written.")
    for item in result:
        if isinstance(item, dict) and item.get("from_name") == CHOICE and item.get("type") == "choices":
            value = item.get("value") or {}
            chosen = value.get("choices") if isinstance(value, dict) else None
            if chosen is not None and not (isinstance(chosen, list) and all(isinstance(c, str) for c in chosen)):
                raise DataContractError(f"{where}: its choices are not a list of texts. Nothing was written.")
            return list(chosen or [])
    return None


# the whole-number fields `rlhf label export` writes, each with its exclusive upper bound
INTEGER_FIELDS = {"query_index": 2**31, "seed": 2**32, "round": 10**6}
_HEX = frozenset("0123456789abcdef")
INVISIBLE = re.compile(f"[{INVISIBLE_CHARACTERS}]")
MAX_SAMPLES = 64


def task_data(item, position: int, where: str) -> tuple[dict, int, str]:
    """``(data, n, label)`` of one exported task, checked field by field: every field `rlhf label
    export` writes, of its type and range, texts that pass the contract's text rule
    (:func:`rlhf_pipeline.text_rules.text_problem`); else :class:`DataContractError` naming the field."""
    if not isinstance(item, dict):
        raise DataContractError(f"{where}: task {position} is a {type(item).__name__}, not a task object.")
    label = f"{where}: task {plain(str(item.get('id', position)), 40)}"
    data = item.get("data")
    if not isinstance(data, dict):
        raise DataContractError(f"{label} has no data object: it was not made by `rlhf label export`.")
    missing = [k for k in (*TASK_FIELDS, "sample0", "sample1") if k not in data]
    if missing:
        raise DataContractError(
            f"{label} lacks {', '.join(missing)} in its data: it was not made by `rlhf label export` (or its "
            "fields were edited). Export tasks with `rlhf label export` and import them into the project."
        )
    n = sum(1 for k in data if k.startswith("sample") and k[6:].isdigit())
    samples = [f"sample{k}" for k in range(n)]
    problems = []
    if n > MAX_SAMPLES or any(k not in data for k in samples):
        problems.append(f"its responses are not sample0 to sample{n - 1} (at most {MAX_SAMPLES})")
    for name, bound in INTEGER_FIELDS.items():
        value = data[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
            problems.append(f"{name} is {quoted(str(value), 40)}, not a whole number from 0 to {bound - 1:,}")
    if data["split"] not in ("train", "test"):
        problems.append(f"split is {quoted(str(data['split']), 40)}, not train or test")
    sha = data["model_sha256"]
    if not (isinstance(sha, str) and len(sha) == 64 and set(sha) <= _HEX):
        problems.append("model_sha256 is not 64 hexadecimal digits")
    for name in ("task_id", "model"):
        value = data[name]
        if not (isinstance(value, str) and value.isprintable() and 0 < len(value) <= 1024):
            problems.append(f"{name} is not a printable text of 1 to 1024 characters")
    for name in ("query", *samples):
        value = data.get(name)
        problem = text_problem(value) if isinstance(value, str) else "not a text"
        if problem is not None:
            problems.append(f"{name} fails the contract's text rule ({problem})")
    shown = [INVISIBLE.sub("", data[k]) for k in samples if isinstance(data.get(k), str)]
    if not problems and len(set(shown)) < len(shown) and len(set(data[k] for k in samples)) == len(shown):
        # zero-width and directional marks are kept (emoji sequences and Persian need them), but two
        # responses that differ only by them look the same to the annotator, whose choice is then a coin
        problems.append("two responses differ only by invisible characters (zero-width or directional marks)")
    if problems:
        raise DataContractError(
            f"{label}: {'; '.join(problems[:4])}. Tasks come from `rlhf label export`; one edited by hand or by "
            "another tool is refused. Nothing was written."
        )
    return data, n, label


def rows_from_export(
    tasks: Iterable, where: str, key: bytes, min_agreement: float | None = None, max_annotations: int = 100
) -> ImportReport:
    """Best-of-N rows from Label Studio's JSON export ``tasks`` (task objects, e.g. from
    :func:`read_export`; see the module docstring). Every task is checked (:func:`task_data`); each
    annotator is named by a pseudonym keyed with the project's ``key``
    (:func:`rlhf_pipeline.project_key.pseudonym`), never by the e-mail address or id the export holds."""
    report = ImportReport(rows=[])
    choices_by_task: dict[str, list[int]] = {}
    positions: dict[str, int] = {}
    for position, item in enumerate(tasks):
        data, n, label = task_data(item, position, where)
        if (first := positions.setdefault(data["task_id"], position)) != position:
            raise DataContractError(  # its answers would count twice
                f"{label}: task_id {plain(data['task_id'], 40)} is also task {first} of this export; an export holds "
                "each task once (one was copied by hand or by another tool). Nothing was written."
            )
        seen: set[str] = set()
        report.tasks += 1
        responses = {str(k) for k in range(n)}
        for annotation in task_annotations(item, label, max_annotations):
            report.annotations += 1
            answered = answered_choice(
                annotation, f"{label} (task_id {data['task_id']})", responses,
                f"one of the {n} responses (0 to {n - 1})", "rlhf label config", seen, report, key,
            )  # fmt: skip
            if answered is None:
                continue
            who, best = answered[0], int(answered[1])
            report.annotators[who] += 1
            choices_by_task.setdefault(data["task_id"], []).append(best)
            report.rows.append(_row(data, n, best, who))
    report.agreement, report.tasks_with_several = pairwise_agreement(choices_by_task)
    if min_agreement is not None and report.agreement is not None and report.agreement < min_agreement:
        worst = [t for t, c in choices_by_task.items() if len(set(c)) > 1][:5]
        raise DataContractError(
            f"{where}: annotators agree on {report.agreement:.2f} of the pairs that labelled one task "
            f"({report.tasks_with_several} tasks with several annotations), below min_agreement {min_agreement:g}. "
            f"Tasks they split on: {', '.join(worst)}. Review the instructions or the annotators; nothing was written."
        )
    return report


def task_annotations(item: dict, label: str, max_annotations: int) -> list[dict]:
    """The annotations of one exported task (``label`` names it): refused (exit 3) when they are not a
    list of objects, or more than ``labelling.max_annotations_per_task``."""
    annotations = item.get("annotations") or []
    if not isinstance(annotations, list):
        raise DataContractError(f"{label}: its annotations are not a list. Nothing was written.")
    if len(annotations) > max_annotations:
        raise DataContractError(
            f"{label}: {len(annotations):,} annotations; at most labelling.max_annotations_per_task = "
            f"{max_annotations} are read. Nothing was written."
        )
    if not all(isinstance(annotation, dict) for annotation in annotations):
        raise DataContractError(f"{label}: an annotation is not an object. Nothing was written.")
    return annotations


def answered_choice(
    annotation: dict, task_label: str, allowed: set[str], what: str, config: str, seen: set[str], report, key: bytes
) -> tuple[str, str] | None:
    """(annotator's pseudonym, the value chosen) of one annotation of a task; None for a cancelled or
    empty one (counted in ``report.cancelled``, ``report.skipped``). Refuses a choice not in ``allowed``
    (``what`` says which, ``config`` names the command that writes the interface) and a second answer by
    one annotator (``seen``, the task's annotators so far). The pseudonym is keyed with ``key``: the same
    person is the same pseudonym in every round, and the identity itself goes nowhere."""
    who = pseudonym(annotation_author(annotation, task_label), key)
    where = f"{task_label}, annotation {plain(str(annotation.get('id')), 40)} by annotator {plain(who, 80)}"
    if annotation.get("was_cancelled"):
        report.cancelled += 1
        return None
    chosen = annotation_choice(annotation, where)
    if not chosen:
        report.skipped += 1
        return None
    if len(chosen) != 1 or chosen[0] not in allowed:
        raise DataContractError(
            f"{where}: the choice {plain(str(chosen), 80)} is not {what}; the project's labelling interface must be "
            f"the one `{config}` writes. Nothing was written."
        )
    if who in seen:
        raise DataContractError(
            f"{where}: this annotator answered the task twice; keep one of the two annotations in Label Studio "
            "(delete the other) and export again. Nothing was written."
        )
    seen.add(who)
    return who, chosen[0]


def _row(data: dict, n: int, best: int, annotator: str) -> dict:
    """One best-of-N preference row, with where it came from."""
    return {
        "query": data["query"],
        **{f"sample{k}": data[f"sample{k}"] for k in range(n)},
        "best": best,
        # not `split`: the preferences stage holds out its own seeded share of the labels
        "query_split": data["split"],
        "annotator": annotator,
        "task_id": data["task_id"],
        "round": int(data["round"]),
        "model": data["model"],
        "model_sha256": data["model_sha256"],
        "seed": int(data["seed"]),
        "query_index": int(data["query_index"]),
    }


def pairwise_agreement(choices_by_task: dict[str, list[int]]) -> tuple[float | None, int]:
    """(share of the pairs of annotations of one task that chose the same response, tasks with >= 2);
    None when no task has two annotations."""
    pairs = agreeing = tasks = 0
    for choices in choices_by_task.values():
        if len(choices) < 2:
            continue
        tasks += 1
        for a, b in combinations(choices, 2):
            pairs += 1
            agreeing += a == b
    return (agreeing / pairs if pairs else None), tasks


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines label file, read (and refused, exit 3) as every preference file is
    (:func:`rlhf_pipeline.io.read_jsonl`); a key a row lacks stays absent, not NaN."""
    columns = read_jsonl(Path(path))
    names = list(columns)
    return [
        {k: v for k, v in zip(names, values) if not (isinstance(v, float) and math.isnan(v))}
        for values in zip(*columns.values())
    ]


def merge_rounds(existing: list[dict], new: list[dict], where: str) -> tuple[list[dict], int, int]:
    """Every round's labels in one file: ``existing`` rows, then the ``new`` rows whose (task_id,
    annotator) is not there yet. Importing the same export again adds nothing; an annotation that
    disagrees with the one already kept for its task and annotator is refused (exit 3), since one of
    the two exports was edited. Returns (rows, added, already there)."""
    kept = {(row.get("task_id"), row.get("annotator")): row for row in existing}
    added, repeated = [], 0
    for row in new:
        key = (row["task_id"], row["annotator"])
        if key in kept:
            if kept[key]["best"] != row["best"]:
                raise DataContractError(
                    f"{where}: task_id {key[0]} by annotator {key[1]} is already labelled {kept[key]['best']} "
                    f"(round {kept[key].get('round')}), and this export says {row['best']}. One of the two exports was "
                    "changed after the labels were taken; nothing was written."
                )
            repeated += 1
            continue
        kept[key] = row
        added.append(row)
    return [*existing, *added], len(added), repeated
