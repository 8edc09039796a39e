"""A real headless Chromium, driven over the DevTools protocol, for the tests that check pages draw.

Chromium is the distribution's package (`apt-get install chromium`); :func:`find_or_install_chromium`
installs it where it is missing and it can (root, apt-get present), and otherwise says why not.
The browser talks DevTools over ``--remote-debugging-pipe`` (file descriptors 3 and 4, one
NUL-terminated JSON message each way): no port, no extra Python package. Every host name but the
ones a test names fails to resolve (``--host-resolver-rules``), so a page that needs the network
shows it as failed requests.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from system_packages import find_or_install

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_or_install_chromium() -> tuple[str | None, str]:
    """(path to Chromium, '') or (None, why it could not be had)."""
    return find_or_install(CHROMIUM_NAMES, "chromium")


@dataclass
class PageReport:
    """What loading a page did: requests made, requests that failed, script errors, and what
    ``expression`` evaluated to once it settled."""

    requested: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    result: object = None
    screenshot: bytes | None = None


class HeadlessChromium:
    def __init__(self, executable: str, reachable: tuple[str, ...] = ()):
        """``reachable``: hosts the page may reach (a test's own server on 127.0.0.1); no other resolves."""
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_pipes():  # the browser reads DevTools commands on fd 3 and answers on fd 4
            # copies first, so neither end is overwritten when os.pipe() handed out 3 or 4 itself;
            # dup2 makes the targets inheritable (os.pipe's own fds close on exec)
            reader, writer = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(reader, 3)
            os.dup2(writer, 4)

        args = [
            executable,
            "--headless",
            "--no-sandbox",  # tests often run as root, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--remote-debugging-pipe",
            "--host-resolver-rules=" + ", ".join(["MAP * ~NOTFOUND", *(f"EXCLUDE {host}" for host in reachable)]),
            "--no-first-run",
            "--disable-background-networking",
            "about:blank",
        ]
        self._proc = subprocess.Popen(
            args, preexec_fn=wire_pipes, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict] = []

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc) -> None:
        self._proc.kill()
        self._proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)

    def _read_message(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe (it exited)")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def send(self, method: str, session: str | None = None, **params) -> dict:
        """One DevTools command; events that arrive meanwhile are kept for :meth:`events`."""
        self._next_id += 1
        command = {"id": self._next_id, "method": method, "params": params}
        if session:
            command["sessionId"] = session
        os.write(self._to_browser, json.dumps(command).encode() + b"\0")
        while True:
            message = self._read_message()
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._events.append(message)

    def open(self, url: str, size: tuple[int, int] = (1400, 900), cookies: dict[str, str] | None = None) -> Page:
        """A new tab of ``size`` showing ``url``; ``cookies`` (name -> value) are set for its origin first
        (a session a test logged in over HTTP)."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Network", "Runtime", "Page"):
            self.send(f"{domain}.enable", session)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            session,
            width=size[0],
            height=size[1],
            deviceScaleFactor=1,
            mobile=False,
        )
        for name, value in (cookies or {}).items():
            self.send("Network.setCookie", session, name=name, value=value, url=url)
        self._events.clear()
        self.send("Page.navigate", session, url=url)
        return Page(self, session)

    def load(
        self,
        url: str,
        expression: str,
        done: str,
        timeout_s: float = 60.0,
        size: tuple[int, int] = (1400, 900),
        screenshot: bool = False,
    ) -> PageReport:
        """Open ``url``; poll ``expression`` (JavaScript) until ``done`` (JavaScript on its value ``v``)
        is true or ``timeout_s`` passes; with ``screenshot``, a PNG of the window (``size``) at the end."""
        page = self.open(url, size)
        report = PageReport()
        report.result = page.wait_for(expression, done, timeout_s)
        if screenshot:
            report.screenshot = page.screenshot()
        for event in self._events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Network.requestWillBeSent":
                report.requested.append(params["request"]["url"])
            elif method == "Network.loadingFailed":
                report.failed.append(f"{params.get('type')} {params.get('errorText')}")
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                report.errors.append(details.get("exception", {}).get("description") or details.get("text"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                report.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        return report


@dataclass
class Page:
    """One tab: evaluate JavaScript in it, wait on it, click in it as a mouse does, photograph it."""

    browser: HeadlessChromium
    session: str

    def evaluate(self, expression: str) -> object:
        value = self.browser.send("Runtime.evaluate", self.session, expression=expression, returnByValue=True)
        return value["result"].get("value")

    def wait_for(self, expression: str, done: str = "v", timeout_s: float = 60.0) -> object:
        """The value of ``expression`` once ``done`` (JavaScript on it, as ``v``) is true; the last value
        when ``timeout_s`` passes first."""
        deadline, value = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            value, finished = self.evaluate(f"(v => [v, !!({done})])({expression})") or [None, False]
            if finished:
                break
            time.sleep(0.25)
        return value

    def click(self, element: str) -> None:
        """A left click at the middle of ``element`` (JavaScript naming one element), as a mouse makes it:
        press and release there, so the page's own handlers decide what happens."""
        box = self.evaluate(
            f"(e => {{ e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect(); "
            f"return [r.x + r.width / 2, r.y + r.height / 2]; }})({element})"
        )
        if not box:
            raise RuntimeError(f"nothing to click: {element} is not on the page")
        x, y = box
        self.browser.send("Input.dispatchMouseEvent", self.session, type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.browser.send(
                "Input.dispatchMouseEvent", self.session, type=kind, x=x, y=y, button="left", clickCount=1
            )

    def screenshot(self) -> bytes:
        return base64.b64decode(self.browser.send("Page.captureScreenshot", self.session, format="png")["data"])


def page_url(path: Path) -> str:
    return path.resolve().as_uri()


# Every plot DVC puts on its page is a <div id=...> under <body>; vega-embed draws a canvas or an SVG in it.
DVC_PLOTS = (
    "({ready: document.readyState, charts: Array.from(document.querySelectorAll('body > div[id]'), "
    "d => [d.id, !!d.querySelector('canvas, svg')])})"
)
DVC_PLOTS_DRAWN = "v.ready === 'complete' && v.charts.length > 0 && v.charts.every(chart => chart[1])"


if __name__ == "__main__":  # python tests/headless_browser.py PAGE.html OUT.png [WIDTH HEIGHT]: the README's screenshot
    import sys

    executable, why = find_or_install_chromium()
    if executable is None:
        sys.exit(why)
    width, height = (int(x) for x in sys.argv[3:5]) if len(sys.argv) > 4 else (1400, 900)
    with HeadlessChromium(executable) as browser:
        report = browser.load(
            page_url(Path(sys.argv[1])), DVC_PLOTS, DVC_PLOTS_DRAWN, size=(width, height), screenshot=True
        )
    Path(sys.argv[2]).write_bytes(report.screenshot)
    print(f"{sys.argv[2]}: {sum(c[1] for c in report.result['charts'])}/{len(report.result['charts'])} charts drawn")
