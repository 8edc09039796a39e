"""The project's own secret key: it seals side-by-side round files (so that one edited by hand after
it was written is refused) and turns people's identities into stable pseudonyms (so that an
annotator's e-mail address never reaches a file git or DVC tracks).

The key is ``$RLHF_PROJECT_KEY`` when set (a worker that gets its secrets from the environment), else
the file :data:`KEY_FILE` in the project, made on first use (readable by its owner only) and ignored
by git and DVC. Keep a copy where you keep other secrets: without it a round cannot be checked, and
the same person gets another pseudonym. Its value is redacted from every message
(:mod:`rlhf_pipeline.redaction`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from rlhf_pipeline.errors import SettingsError
from rlhf_pipeline.redaction import remember

KEY_VARIABLE = "RLHF_PROJECT_KEY"
KEY_FILE = ".rlhf/project.key"
PSEUDONYM_PREFIX = "annotator-"


def project_key(root: str | Path, create: bool = True) -> bytes:
    """The project's key (see the module docstring); made when missing and ``create``, else SettingsError."""
    given = os.environ.get(KEY_VARIABLE, "").strip()
    if given:
        return given.encode()
    path = Path(root, KEY_FILE)
    if not path.is_file():
        if not create:
            raise SettingsError(
                f"no project key: neither ${KEY_VARIABLE} nor {path} is there. Side-by-side rounds are sealed with the "
                "key of the project that wrote them; restore the key file (or set the variable) from where you keep "
                "it, then run the command again. Nothing was read or written."
            )
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:  # exclusive: two first uses at once agree on one key
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_hex(32) + "\n")
        except FileExistsError:
            pass
    key = path.read_text().strip()
    remember(key)
    return key.encode()


def pseudonym(identity: str, key: bytes) -> str:
    """A stable pseudonym of a person's identity (an e-mail address, a user id): the same identity and
    key give the same pseudonym; without the key it cannot be turned back or guessed from a list."""
    return PSEUDONYM_PREFIX + hmac.new(key, identity.encode(), hashlib.sha256).hexdigest()[:16]


def seal(payload: dict, key: bytes) -> str:
    """A keyed digest of ``payload`` (JSON with sorted keys): whoever edits the payload without the key
    cannot make its seal agree."""
    text = json.dumps(payload, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def seal_agrees(payload: dict, key: bytes, recorded: object) -> bool:
    """Whether ``recorded`` is the seal of ``payload`` under ``key``, compared in constant time (as bytes: a
    hand-edited seal may hold characters ``compare_digest`` refuses in a str)."""
    if not isinstance(recorded, str):
        return False
    return hmac.compare_digest(seal(payload, key).encode(), recorded.encode("utf-8", "surrogatepass"))
