"""A real Label Studio server for the tests: the one `make label-studio` installs in .label-studio/
(a venv of its own, from labelling/label-studio.lock), started on 127.0.0.1 with an SQLite database in
a temporary folder, an admin account and a legacy API token; and the REST calls a labelling team
makes (a project with the shipped interface, tasks in, a second annotator through the organisation's
invite link, annotations, the JSON export)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from headless_browser import HeadlessChromium
from ssh_server import _free_port

REPO = Path(__file__).resolve().parents[1]
LABEL_STUDIO = REPO / ".label-studio" / "bin" / "label-studio"
TEMPLATE = REPO / ".label-studio" / "template"  # an empty, migrated database `make label-studio` made
# off: Label Studio's error reports to Sentry, its usage analytics and its PyPI version check
QUIET = {"SENTRY_DSN": "", "FRONTEND_SENTRY_DSN": "", "COLLECT_ANALYTICS": "false", "LATEST_VERSION_CHECK": "false"}
CHOICE_BOXES = "document.querySelectorAll('label.lsf-choice__checkbox')"  # the page's <Choice>s, in order
NOT_INSTALLED = f"Label Studio is not installed at {LABEL_STUDIO}: `make label-studio` installs it (`make test` does)"


@dataclass
class Annotator:
    id: int
    email: str
    token: str
    cookies: dict[str, str]  # a logged-in browser session (sessionid, csrftoken)


@dataclass
class LabelStudio:
    url: str
    admin: Annotator
    process: subprocess.Popen
    log: Path

    def api(self, method: str, path: str, who: Annotator | None = None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Token {(who or self.admin).token}"}
        response = httpx.request(method, f"{self.url}{path}", headers=headers, timeout=120, **kwargs)
        if response.status_code >= 400:
            raise AssertionError(f"{method} {path}: HTTP {response.status_code} {response.text[:500]}")
        return response

    def create_project(self, title: str, label_config: str, annotators_per_task: int) -> int:
        body = {"title": title, "label_config": label_config, "maximum_annotations": annotators_per_task}
        return self.api("POST", "/api/projects/", json=body).json()["id"]

    def import_tasks(self, project: int, tasks: list[dict]) -> list[int]:
        self.api("POST", f"/api/projects/{project}/import", json=tasks)
        listed = self.api("GET", "/api/tasks/", params={"project": project, "page_size": 1000}).json()["tasks"]
        return sorted(t["id"] for t in listed)

    def annotate(self, task: int, choice: str, who: Annotator) -> None:
        result = [{"from_name": "best", "to_name": "query", "type": "choices", "value": {"choices": [choice]}}]
        self.api("POST", f"/api/tasks/{task}/annotations/", who=who, json={"result": result})

    def export(self, project: int) -> list[dict]:
        return self.api("GET", f"/api/projects/{project}/export", params={"exportType": "JSON"}).json()

    def annotations_by(self, project: int, person: Annotator) -> list[tuple[int, dict]]:
        """(task id, annotation) of each annotation ``person`` made in ``project``."""
        return [(t["id"], a) for t in self.export(project) for a in t["annotations"] if a["completed_by"] == person.id]

    def personal_access_token(self, person: Annotator) -> str:
        """A new personal access token of ``person`` (a JWT refresh token: the kind Label Studio 1.23's
        Account & Settings page makes), made in their logged-in session."""
        with httpx.Client(base_url=self.url, cookies=person.cookies, timeout=60) as session:
            headers = {"X-CSRFToken": person.cookies["csrftoken"], "Referer": self.url}
            made = session.post("/api/token/", headers=headers)
        if made.status_code != 201:
            raise AssertionError(f"personal access token of {person.email}: HTTP {made.status_code} {made.text[:300]}")
        return made.json()["token"]

    def sign_up(self, email: str, password: str) -> Annotator:
        """A second person joins the organisation the way Label Studio invites people: the invite
        link's sign-up form (a Django form with its CSRF token), then their own API token."""
        invite = self.api("GET", "/api/invite").json()["invite_url"]
        with httpx.Client(base_url=self.url, timeout=60) as browser:
            browser.get(invite)
            form = {
                "csrfmiddlewaretoken": browser.cookies["csrftoken"],
                "email": email,
                "password": password,
                "allow_newsletters": "false",
            }
            signed = browser.post(invite, data=form, headers={"Referer": f"{self.url}{invite}"})
            if signed.status_code != 302:
                raise AssertionError(f"sign-up of {email}: HTTP {signed.status_code} {signed.text[:300]}")
            token = browser.get("/api/current-user/token").json()["token"]
            me = browser.get("/api/current-user/whoami").json()
            cookies = {name: browser.cookies[name] for name in ("sessionid", "csrftoken")}
        return Annotator(me["id"], email, token, cookies)


def start_label_studio(data_dir: Path, timeout_s: float = 240.0) -> LabelStudio:
    """Label Studio on a free port of 127.0.0.1 (it binds nothing else), answering /health; raises
    with the tail of its log when it does not come up. It starts from a copy of the migrated
    template database when there is one (3 s instead of 30)."""
    port, token = _free_port(), secrets.token_hex(20)
    if TEMPLATE.is_dir():
        shutil.copytree(TEMPLATE, data_dir, dirs_exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "label-studio.log"
    email, password = "admin@example.com", secrets.token_urlsafe(12)
    command = [
        str(LABEL_STUDIO),
        "start",
        "--no-browser",
        "--host",
        "127.0.0.1",
        "--internal-host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        # "--flag=value": a random password may start with "-", which argparse would read as a flag
        f"--username={email}",
        f"--password={password}",
        f"--user-token={token}",
        "--enable-legacy-api-token",  # 1.23 refuses --user-token's token without it
    ]
    env = {**os.environ, **QUIET, "HOME": str(data_dir), "LABEL_STUDIO_BASE_DATA_DIR": str(data_dir)}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                admin = Annotator(1, email, token, {})
                server = LabelStudio(url, admin, process, log)
                admin.id = server.api("GET", "/api/current-user/whoami").json()["id"]
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    exited = process.poll()
    stop(process)
    what = f"exited with code {exited}" if exited is not None else f"did not answer {url}/health within {timeout_s:g} s"
    raise RuntimeError(f"Label Studio {what}:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def label_in_browser(chromium: str, server: LabelStudio, project: int, person: Annotator, choice: str) -> bytes:
    """``person`` opens the project's labelling stream in a real browser, ticks the choice whose text
    starts with ``choice`` (as the page shows it: "Response 3", "A") with a mouse click and submits;
    returns a screenshot of the page with the choice ticked, taken before the submit."""
    with HeadlessChromium(chromium, reachable=("127.0.0.1",)) as browser:
        page = browser.open(f"{server.url}/projects/{project}/data?labeling=1", cookies=person.cookies)
        shown = page.wait_for(f"{CHOICE_BOXES}.length", "v > 0", timeout_s=90)
        if not shown:
            raise AssertionError("the labelling page showed no choices within 90 s")
        texts = page.evaluate(f"Array.from({CHOICE_BOXES}, e => e.innerText)")
        index = next((i for i, text in enumerate(texts) if text.strip().startswith(choice)), None)
        if index is None:
            raise AssertionError(f"the page shows no choice {choice!r}: {texts}")
        page.click(f"{CHOICE_BOXES}[{index}]")
        ticked = page.wait_for(
            "Array.from(document.querySelectorAll('input[type=checkbox]'), e => e.checked)", "v.some(Boolean)", 10
        )
        if ticked != [i == index for i in range(shown)]:
            raise AssertionError(f"after the click on {choice} the boxes read {ticked}")
        screenshot = page.screenshot()
        page.click("document.querySelector('button[aria-label=\"Submit current annotation\"]')")
        deadline = time.monotonic() + 30
        while not server.annotations_by(project, person) and time.monotonic() < deadline:
            time.sleep(0.5)  # the page posts the annotation after the click
    return screenshot


if __name__ == "__main__":  # python tests/label_studio_server.py TASKS.json OUT.png: the README's screenshot
    import sys
    import tempfile

    from headless_browser import find_or_install_chromium

    executable, why = find_or_install_chromium()
    if executable is None or not LABEL_STUDIO.exists():
        sys.exit(why or NOT_INSTALLED)
    with tempfile.TemporaryDirectory() as scratch:
        server = start_label_studio(Path(scratch))
        try:
            config = (REPO / "labelling" / "best_of_4.xml").read_text()
            project = server.create_project("best of 4", config, annotators_per_task=1)
            server.import_tasks(project, json.loads(Path(sys.argv[1]).read_text()))
            person = server.sign_up("labeller@example.com", secrets.token_urlsafe(12))
            Path(sys.argv[2]).write_bytes(label_in_browser(executable, server, project, person, "Response 2"))
        finally:
            stop(server.process)
    print(f"{sys.argv[2]}: Label Studio's labelling page, Response 2 ticked")
