"""The one home of secret redaction: every message, log line, exception text and written artifact that
may hold text from outside (a server's answer, a redirect's target, an HTTP library's error, an
environment variable) passes through :func:`redact` *before* it is cut or formatted, so a secret is
never printed, not even in part.

What counts as a secret:
- the values of the environment variables that carry one (:data:`SECRET_VARIABLES`, and any variable
  whose name says token, secret, password or key), and the user:password of a URL in the environment;
- every secret obtained at run time from one of those (a personal access token's exchanged access
  token): the code that obtains it calls :func:`remember`;
- by its shape, wherever it appears: a URL's ``user:password@``, an ``Authorization`` header's value,
  a ``Token``/``Bearer``/``Basic`` credential, and JSON or query fields named like a credential.

A known secret is removed whole and in pieces: any run of :data:`PIECE` characters of it is replaced,
so a message cut in the middle of a secret, or a server echoing half of one, shows none of it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

MASK = "<redacted>"
MIN_SECRET = 4  # shorter user names and passwords of a URL are masked by the URL's shape only
PIECE = 8  # the shortest run of a known secret's characters that is removed wherever it appears
SECRET_VARIABLES = ("LABEL_STUDIO_API_KEY", "RLHF_PROJECT_KEY")
URL_VARIABLES = ("LABEL_STUDIO_URL",)
_SECRET_NAME = re.compile(r"(?i)(token|secret|passw|api_?key|private_?key|credential)")
_remembered: set[str] = set()

_PATTERNS = (
    # scheme://user:password@host: the whole user information
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s@'\"<>]+@"), r"\1" + MASK + "@"),
    # an Authorization header as HTTP libraries, proxies and servers echo it
    (
        re.compile(
            r"(?i)\b((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?)(?:(?:token|bearer|basic|jwt)\s+)?[^\s\"',;&}]+"
        ),
        r"\1" + MASK,
    ),
    # a credential after its scheme's name, as the header carries it (the scheme names are capitalised there)
    (re.compile(r"\b(Token|Bearer|Basic|JWT)(\s+)[A-Za-z0-9._~+/=\-]{8,}"), r"\1\2" + MASK),
    # JSON or query fields named like a credential: "access": "...", token=...
    (
        re.compile(
            r"(?i)([\"']?\b(?:access|refresh|access_token|refresh_token|token|api_?key|password|passwd|secret)\b[\"']?"
            r"\s*[:=]\s*[\"']?)[^\s\"',;&}]{4,}"
        ),
        r"\1" + MASK,
    ),
)


def remember(secret: str | None) -> None:
    """Treat ``secret`` (a token obtained at run time) as known from now on, in this process."""
    if secret and len(secret) >= MIN_SECRET:
        _remembered.add(secret)


def known_secrets(environ: Mapping[str, str] | None = None) -> set[str]:
    """The secrets this process knows: the secret-carrying environment variables' values, a URL's
    user:password in the environment, and those :func:`remember` was given."""
    environ = os.environ if environ is None else environ
    found = set(_remembered)
    for name, value in environ.items():
        if not value:
            continue
        named = name in SECRET_VARIABLES and len(value) >= MIN_SECRET
        if named or (_SECRET_NAME.search(name) and len(value) >= PIECE):
            found.add(value)
    for name in URL_VARIABLES:
        parts = urlsplit(environ.get(name, "").strip()) if "://" in environ.get(name, "") else None
        if parts is not None and "@" in parts.netloc:
            userinfo = parts.netloc.rsplit("@", 1)[0]
            found.update(piece for piece in (userinfo, *userinfo.split(":", 1)) if len(piece) >= MIN_SECRET)
    return found


def _masked_spans(text: str, secrets: Iterable[str]) -> list[tuple[int, int]]:
    """(start, end) of every occurrence in ``text`` of a secret, or of a run of :data:`PIECE` of its characters."""
    spans = []
    for secret in secrets:
        if len(secret) < PIECE:  # a short one only where it stands alone: "pw" is no secret inside "pwd"
            pattern = r"(?<![A-Za-z0-9])" + re.escape(secret) + r"(?![A-Za-z0-9])"
            spans += [match.span() for match in re.finditer(pattern, text)]
            continue
        pieces = {secret[i : i + PIECE] for i in range(len(secret) - PIECE + 1)}
        for i in range(len(text) - PIECE + 1):
            if text[i : i + PIECE] in pieces:
                spans.append((i, i + PIECE))
    return spans


def redact(text: object, environ: Mapping[str, str] | None = None) -> str:
    """``text`` (anything: it is made a ``str``) with every secret removed (see the module docstring)."""
    text = str(text)
    spans = sorted(_masked_spans(text, known_secrets(environ)))
    if spans:
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        pieces, at = [], 0
        for start, end in merged:
            pieces += [text[at:start], MASK]
            at = end
        text = "".join(pieces) + text[at:]
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def shown_url(url: str) -> str:
    """``url`` as a message may show it: scheme, host, port and path, without user, password, query or
    fragment (where a redirect or a mistyped address carries a token)."""
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return MASK
    netloc = (f"[{host}]" if ":" in host else host) + port
    return redact(urlunsplit((parts.scheme, netloc, parts.path, "", "")))


def header_safe(value: str) -> bool:
    """Whether ``value`` can travel in an HTTP header as it is: visible ASCII, no line break or control."""
    return bool(value) and all(0x21 <= ord(c) <= 0x7E for c in value)


class RedactingStream:
    """A text stream that passes everything written to it through :func:`redact` (``sys.stdout`` and
    ``sys.stderr`` of an ``rlhf`` process: tracebacks and libraries' own warnings included)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text) if text.strip() else text)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
