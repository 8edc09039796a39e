"""The HTTP client of a running Label Studio: a project's JSON export pulled (:func:`fetch_export`,
spooled, within ``labelling``'s bounds) and tasks sent (:func:`send_tasks`). The address and the API token
come from the environment, as Label Studio's own SDK reads them, never from params or files in git; every
error text is redacted before it is cut or shown (:mod:`rlhf_pipeline.redaction`)."""

from __future__ import annotations

import io
import os
import tempfile
import threading

from rlhf_pipeline.errors import DataContractError, PipelineError, SettingsError, plain, quoted
from rlhf_pipeline.io import UTF8_OPTIONAL_BOM
from rlhf_pipeline.params.labelling import LabellingParams
from rlhf_pipeline.redaction import header_safe, redact, remember, shown_url

URL_VARIABLE, TOKEN_VARIABLE = "LABEL_STUDIO_URL", "LABEL_STUDIO_API_KEY"  # the names Label Studio's SDK reads
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
