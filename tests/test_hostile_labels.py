"""The labelling doors refuse what is bad and leak nothing (issue 53): `rlhf label import --from-server`
against a local fake server that redirects, floods, trickles, answers another shape or refuses the
token after exchanging it, and `rlhf label import` of hand-made exports. Each case: the exit code of
the README's table, one paragraph, bounded time and memory, nothing written, the token never printed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_labelling import answer
from test_labelling import task as labelling_task

pytestmark = pytest.mark.e2e  # fake labelling servers on 127.0.0.1, and the rlhf command against each

TOKEN = "s3cret-legacy-token-0123456789"
REDIRECT_PASSWORD, REDIRECT_TOKEN = "rdpw-6t5r4e-k9m2", "rdqt-3w2q1a-x7v8"  # no English word in 8 characters
PAT = "aaaa.bbbb.cccc-personal-access-token"  # two dots: exchanged for an access token first
RSS_LIMIT_KB = 1 << 20  # 1 GiB
# the child's peak RSS, read by a wrapper (this test process's own children would blur RUSAGE_CHILDREN)
MEASURED = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def task(number: int, annotations: list[dict], **data) -> dict:
    """A task as `rlhf label export` writes it (two responses), with ``data``'s fields edited."""
    made = labelling_task(number, annotations, n=2)
    made["data"].update(data)
    return made


GOOD_EXPORT = [task(i, [answer(i, 1, str(i % 2))]) for i in range(4)]


class FakeLabelStudio(BaseHTTPRequestHandler):
    """Answers as the server's ``mode`` says; every request's path and Authorization are recorded."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):  # the personal access token's exchange
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        length = int(self.headers.get("content-length", 0))
        self.rfile.read(length)
        self._json(200, {"access": self.server.access})

    def do_GET(self):
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        mode = self.server.mode
        if mode == "redirect-with-secrets":  # a token in the target's user, password and query
            return self._redirect(self.server.other.replace("http://", f"http://bob:{REDIRECT_PASSWORD}@") + (
                f"?token={REDIRECT_TOKEN}&next=1#{REDIRECT_TOKEN}"
            ))  # fmt: skip
        if mode == "echo-near-the-cut":  # the Authorization header echoed where a 300-character cut falls
            credential = self.headers.get("Authorization", "").split(" ", 1)[-1]
            body = "e" * 290 + f"Authorization: {self.headers.get('Authorization')} / {credential}"
            return self._send(500, "text/plain", body.encode())
        if mode == "redirect-other":
            return self._redirect(self.server.other)
        if mode == "redirect-file":
            return self._redirect("file:///etc/passwd")
        if mode == "unauthorised":
            return self._json(401, {"detail": "Invalid token."})
        if mode == "echo-token":
            return self._json(500, {"detail": f"bad token {self.headers.get('Authorization')}"})
        if mode == "html":
            body = b"<html><body>Sign in</body></html>"
            return self._send(200, "text/html", body)
        if mode == "other-shape":
            return self._json(200, {"count": 4, "results": GOOD_EXPORT})
        if mode == "declared-2gb":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(2 << 30))
            self.end_headers()
            self.wfile.write(b"[")
            return None
        if mode in ("flood", "trickle"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"[" + b'{"id": 1, "data": {}},' * 4000 if mode == "flood" else b"["
            try:
                for _ in range(100_000 if mode == "flood" else 600):  # flood: ~9 GB if never stopped
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    chunk = b'{"id": 1, "data": {}},' * 4000 if mode == "flood" else b" "
                    if mode == "trickle":
                        time.sleep(1)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return None
        if mode == "many-annotations":  # one task, 10^6 annotations (~40 MB), written as text: quick to make
            head = json.dumps([task(0, [])])[:-3]  # up to the annotations' opening bracket
            annotations = ",".join(f'{{"id": {i}, "completed_by": {i}, "result": []}}' for i in range(1_000_000))
            return self._send(200, "application/json", f"{head}{annotations}]}}]".encode())
        return self._json(200, GOOD_EXPORT)

    def _redirect(self, location: str):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _json(self, status: int, value) -> None:
        self._send(status, "application/json", json.dumps(value).encode())

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def servers():
    """The fake server on 127.0.0.1, and another host (127.0.0.2) that a redirect points to."""
    started = []
    for host in ("127.0.0.1", "127.0.0.2"):
        server = ThreadingHTTPServer((host, 0), FakeLabelStudio)
        server.daemon_threads = True
        server.seen, server.mode, server.access = [], "good", "short-lived-access"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    main, other = started
    main.other = f"http://127.0.0.2:{other.server_address[1]}/api/projects/1/export"
    yield main, other
    for server in started:
        server.shutdown()
        server.server_close()


def import_from(tmp_path: Path, url: str, token: str = TOKEN, **limits):
    """`rlhf label import --from-server 1 out.jsonl` in a project whose params set ``limits``:
    (exit code, stderr without the RSS line, peak RSS in KiB, seconds)."""
    params = {"labelling": {"server_timeout_s": 5, "max_export_mb": 1, **limits}}
    (tmp_path / "params.yaml").write_text(json.dumps(params))
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "LABEL_STUDIO_URL": url, "LABEL_STUDIO_API_KEY": token}
    command = [sys.executable, "-m", "rlhf_pipeline.cli", "label", "import", "--from-server", "1", "out.jsonl"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", MEASURED, *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    seconds = time.monotonic() - start
    lines = proc.stderr.splitlines()
    rss = int(lines[-1].split()[-1])
    return proc.returncode, "\n".join(lines[:-1]), proc.stdout, rss, seconds


def assert_refused(tmp_path, result, code: int, *words: str, token: str = TOKEN, within_s: float = 60) -> None:
    returncode, err, out, rss, seconds = result
    assert returncode == code, f"exit {returncode} (wanted {code}): {err[-1500:]}"
    assert "Traceback" not in err and err.count("\n") <= 2, err[-1500:]
    for word in words:
        assert word in err, f"{word!r} not in: {err}"
    assert token not in err and token not in out
    assert not (tmp_path / "out.jsonl").exists() and not list(tmp_path.glob("*.tmp*"))
    assert rss < RSS_LIMIT_KB, f"peak RSS {rss / 1024:.0f} MiB"
    assert seconds < within_s, f"{seconds:.0f} s"


def test_a_good_server_s_export_is_imported(servers, tmp_path):
    main, _ = servers
    returncode, err, out, _, _ = import_from(tmp_path, f"http://127.0.0.1:{main.server_address[1]}")
    assert returncode == 0, err
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4
    assert main.seen == [("/api/projects/1/export?exportType=JSON&download_all_tasks=false", f"Token {TOKEN}")]


@pytest.mark.parametrize("mode", ["redirect-other", "redirect-file"])
def test_a_redirect_is_refused_and_the_token_goes_nowhere_else(servers, tmp_path, mode):
    main, other = servers
    main.mode = mode
    result = import_from(tmp_path, f"http://127.0.0.1:{main.server_address[1]}")
    assert_refused(tmp_path, result, 2, "redirect (HTTP 302)", "not followed", "LABEL_STUDIO_URL")
    assert other.seen == [] and len(main.seen) == 1


@pytest.mark.parametrize(
    "mode, limits, code, words",
    [
        ("flood", {}, 3, ("over labelling.max_export_mb = 1 MiB",)),
        ("declared-2gb", {}, 3, ("over labelling.max_export_mb = 1 MiB",)),
        ("trickle", {"server_timeout_s": 3}, 1, ("within labelling.server_timeout_s = 3 s",)),
        ("html", {}, 3, ("'text/html'", "not JSON")),
        ("other-shape", {}, 3, ("one list of tasks",)),
        (
            "many-annotations",
            {"max_export_mb": 200, "server_timeout_s": 50},
            3,
            ("1,000,000 annotations", "max_annotations_per_task = 100"),
        ),
        ("echo-token", {}, 1, ("HTTP 500", "<redacted>")),
    ],
)
def test_a_hostile_answer_is_stopped_at_its_bound(servers, tmp_path, mode, limits, code, words):
    main, _ = servers
    main.mode = mode
    result = import_from(tmp_path, f"http://127.0.0.1:{main.server_address[1]}", **limits)
    assert_refused(tmp_path, result, code, *words)


def test_a_token_refused_after_its_exchange_is_exit_2(servers, tmp_path):
    main, _ = servers
    main.mode = "unauthorised"
    result = import_from(tmp_path, f"http://127.0.0.1:{main.server_address[1]}", token=PAT)
    assert_refused(tmp_path, result, 2, "refused the token", "HTTP 401", token=PAT)
    assert [path for path, _ in main.seen] == ["/api/token/refresh", main.seen[1][0]]
    assert main.seen[1][1] == "Bearer short-lived-access"


@pytest.mark.parametrize("url", ["http://labels.example.org:8080", "ftp://127.0.0.1/", "http://user:pw@127.0.0.1:1"])
def test_plain_http_to_another_host_or_another_scheme_is_refused_before_connecting(tmp_path, url):
    result = import_from(tmp_path, url)
    assert_refused(tmp_path, result, 2, "LABEL_STUDIO_URL", "Nothing was sent")


def test_plain_http_to_another_host_is_tried_where_params_allow_it(tmp_path):
    returncode, err, _, _, _ = import_from(tmp_path, "http://labels.invalid:9", allow_plain_http=True)
    assert returncode == 1 and "did not answer" in err and TOKEN not in err


# --------------------------------------------------------------------------------------------
# hand-made exports (a file)
# --------------------------------------------------------------------------------------------
def run_import(tmp_path: Path, labelling: dict):
    """`rlhf label import export.json out.jsonl` under params whose labelling section is ``labelling``:
    (exit code, stderr without the RSS line, stdout, peak RSS in KiB, seconds)."""
    (tmp_path / "params.yaml").write_text(json.dumps({"labelling": labelling}))
    command = [sys.executable, "-m", "rlhf_pipeline.cli", "label", "import", "export.json", "out.jsonl"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", MEASURED, *command], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    lines = proc.stderr.splitlines()
    return proc.returncode, "\n".join(lines[:-1]), proc.stdout, int(lines[-1].split()[-1]), time.monotonic() - start


def import_file(tmp_path: Path, export: str | bytes, **limits):
    path = tmp_path / "export.json"
    path.write_bytes(export if isinstance(export, bytes) else export.encode())
    return run_import(tmp_path, {"max_export_mb": 64, **limits})


def edited(**data) -> str:
    return json.dumps([task(0, [answer(1, 1, "0")], **data), *GOOD_EXPORT[1:]])


@pytest.mark.parametrize(
    "export, words",
    [
        ("[" * 100_000 + "]" * 100_000, ("nests deeper",)),
        (json.dumps([task(0, [answer(1, 1, "<script>alert(1)</script>")])]), ("is not one of the 2 responses",)),
        (edited(sample1="a bidi \u202e override"), ("sample1 fails the contract's text rule",)),
        (edited(sample1="response 0 to\u200b query 0"), ("differ only by invisible characters",)),
        (json.dumps([task(0, [answer(1, 1, "7")])]), ("is not one of the 2 responses",)),
        (json.dumps([task(0, [answer(1, 1, "\u0663")])]), ("is not one of the 2 responses",)),  # an Arabic-Indic 3
        (edited(query_index=-1), ("query_index is '-1'",)),
        (edited(seed=2**80), ("seed is",)),
        (edited(round="two"), ("round is 'two'",)),
        (json.dumps([{"id": "x" * 10_000, "data": 5}]), ("has no data object",)),
        (json.dumps([task(0, [{"id": -5, "completed_by": [1], "result": []}])]), ("completed_by is",)),
        (json.dumps([task(0, [answer(1, 1, "0")])])[:-3], ("not valid JSON",)),
    ],
)
def test_a_hand_made_export_that_cannot_be_labels_is_refused_by_task_and_field(tmp_path, export, words):
    assert_refused(tmp_path, import_file(tmp_path, export), 3, *words)


def test_zero_width_characters_in_a_text_are_kept(tmp_path):
    """A zero-width joiner holds an emoji sequence together (and a non-joiner writes Persian): kept as sent."""
    family = "a family \U0001f468\u200d\U0001f469\u200d\U0001f467 ok"
    returncode, err, _, _, _ = import_file(tmp_path, edited(query=family))
    assert returncode == 0, err
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["query"] == family


def test_a_large_export_is_read_in_bounded_memory_and_one_over_the_bound_is_refused_unread(tmp_path):
    # ~25 MB of valid tasks, streamed: the rows, not the text, are what stays in memory
    tasks = ",".join(json.dumps(task(i, [answer(i, 1, "0")], query="q " * 4000 + str(i))) for i in range(3000))
    text = "[" + tasks + "]"
    returncode, err, _, rss, _ = import_file(tmp_path, text, max_export_mb=256)
    assert returncode == 0, err
    size_kb = len(text) // 1024
    assert rss < RSS_LIMIT_KB, f"peak RSS {rss / 1024:.0f} MiB for a {size_kb / 1024:.0f} MiB export"
    (tmp_path / "out.jsonl").unlink()
    assert_refused(tmp_path, import_file(tmp_path, text, max_export_mb=16), 3, "over labelling.max_export_mb = 16 MiB")


def test_a_1_gib_export_is_refused_by_its_size_unread_or_read_only_as_far_as_it_is_wrong(tmp_path):
    """A 1 GiB file (sparse: its size without its bytes): over the default bound it is refused from its
    size; under a bound raised past it, reading stops at the first character that is not a list."""
    path = tmp_path / "export.json"
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)
    for limits, words in (
        ({}, "1,024 MiB, over labelling.max_export_mb = 256 MiB"),
        ({"max_export_mb": 2048}, "starts with"),
    ):
        assert_refused(tmp_path, run_import(tmp_path, limits), 3, words)


# --------------------------------------------------------------------------------------------
# secrets (issue 106): each planted in one place, searched for in every stream and written file
# --------------------------------------------------------------------------------------------
ACCESS = "xacc-9h8g7f6e-p0o9"  # what a personal access token is exchanged for
URL_PASSWORD = "upw-k2j3h4g5-b6n7"
PLANTED_PAT = "pat1.x9c8v7b6.n5m4q3w2"  # two dots: exchanged for ACCESS first


def shown_anywhere(tmp_path: Path, *streams: str) -> str:
    """Every output stream, and every file the command left under ``tmp_path``, as one text."""
    files = [p.read_bytes().decode("utf-8", "replace") for p in sorted(tmp_path.rglob("*")) if p.is_file()]
    return "\n".join([*streams, *files])


def pieces_shown(text: str, secret: str) -> list[str]:
    """Every 8-character piece of ``secret`` that ``text`` holds."""
    return sorted({secret[i : i + 8] for i in range(len(secret) - 7)} & {text[i : i + 8] for i in range(len(text) - 7)})


@pytest.mark.parametrize(
    "mode, url_of, token, code, secrets",
    [
        ("good", lambda port: f"http://alice:{URL_PASSWORD}@127.0.0.1:{port}", TOKEN, 2, (URL_PASSWORD, TOKEN)),
        ("redirect-with-secrets", None, TOKEN, 2, (REDIRECT_PASSWORD, REDIRECT_TOKEN, TOKEN)),
        ("echo-near-the-cut", None, TOKEN, 1, (TOKEN,)),
        ("echo-near-the-cut", None, PLANTED_PAT, 1, (PLANTED_PAT, ACCESS)),  # the exchanged token echoed back
        ("good", None, "t\u00e9k-4r5t6y7u8i", 2, ("t\u00e9k-4r5t6y7u8i",)),
        ("good", None, "nl-a1s2\nd3f4g5h6", 2, ("nl-a1s2\nd3f4g5h6",)),
    ],
)
def test_no_secret_is_printed_or_written_whole_or_in_part(servers, tmp_path, mode, url_of, token, code, secrets):
    main, _ = servers
    main.mode, main.access = mode, ACCESS
    port = main.server_address[1]
    returncode, err, out, _, _ = import_from(tmp_path, (url_of or (lambda p: f"http://127.0.0.1:{p}"))(port), token)
    assert returncode == code, err
    assert "Traceback" not in err and err.count("\n") <= 2, err
    shown = shown_anywhere(tmp_path, err, out)
    for secret in secrets:
        assert pieces_shown(shown, secret) == [] and secret not in shown, f"{secret!r} shown in: {err}"
    if not header_safe_token(token):
        assert "LABEL_STUDIO_API_KEY holds a character an HTTP header cannot carry" in err and main.seen == []


def header_safe_token(token: str) -> bool:
    return all(0x21 <= ord(c) <= 0x7E for c in token)
