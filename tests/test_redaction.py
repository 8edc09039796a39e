"""The one redaction home (rlhf_pipeline/redaction.py): every secret it knows, whole or in pieces, and
every credential by its shape, removed from a text before it is cut or shown; the retrain flow's
errors and children's output pass through it too."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `flows` lives at the repo root

from flows.retrain.dvc_project import RetrainError, capture  # noqa: E402
from rlhf_pipeline.redaction import (  # noqa: E402
    MASK,
    PIECE,
    RedactingStream,
    header_safe,
    known_secrets,
    redact,
    remember,
    shown_url,
)

TOKEN = "legacy-token-1a2b3c4d5e6f7a8b9c0d"
ENVIRON = {"LABEL_STUDIO_API_KEY": TOKEN, "LABEL_STUDIO_URL": "http://carol:url-password-z9y8x7@host:8080"}


def pieces(secret: str) -> set[str]:
    return {secret[i : i + PIECE] for i in range(len(secret) - PIECE + 1)}


def leaks(text: str, secret: str) -> list[str]:
    """Every :data:`PIECE`-character piece of ``secret`` that ``text`` shows."""
    return sorted(piece for piece in pieces(secret) if piece in text)


def test_a_known_secret_is_removed_whole_and_in_any_piece():
    for text in (
        f"the server said: bad token {TOKEN} (retry)",
        f"cut here: ...{TOKEN[:11]}",  # a message cut in the middle of the token
        f"{TOKEN[5:20]} echoed in part",  # a server echoing the middle of it
    ):
        shown = redact(text, ENVIRON)
        assert leaks(shown, TOKEN) == [] and MASK in shown, shown
    assert redact("nothing secret here", ENVIRON) == "nothing secret here"


def test_the_url_s_user_and_password_in_the_environment_are_secrets_and_short_ones_only_stand_alone():
    assert {"carol", "url-password-z9y8x7", TOKEN} <= known_secrets(ENVIRON)
    assert "url-password-z9y8x7" not in redact("login url-password-z9y8x7 refused", ENVIRON)
    # "carol" is short: removed where it stands alone, not inside another word
    assert redact("carol asked; carolina answered", ENVIRON) == f"{MASK} asked; carolina answered"


@pytest.mark.parametrize(
    "text, kept",
    [
        ("GET https://dave:hunter2-pass@labels.example.org/api", "https://<redacted>@labels.example.org/api"),
        ("header Authorization: Token abcdefgh12345678", "Authorization: <redacted>"),
        ('{"authorization": "Bearer zzzzyyyyxxxx1111"}', '"authorization": "<redacted>"'),
        ("sent Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig", "Bearer <redacted>"),
        ('{"access": "short-lived-access-token", "refresh": "r-token-0987"}', '"access": "<redacted>"'),
        ("https://host/x?token=qwertyuiop&page=2", "token=<redacted>&page=2"),
    ],
)
def test_credentials_are_removed_by_their_shape_wherever_they_appear(text, kept):
    shown = redact(text, {})
    assert kept in shown, shown
    for secret in ("hunter2-pass", "abcdefgh12345678", "zzzzyyyyxxxx1111", "eyJhbGciOiJIUzI1NiJ9", "qwertyuiop"):
        assert secret not in shown


def test_a_remembered_secret_is_redacted_from_then_on():
    access = "exchanged-access-token-5e6f7a8b"
    assert access in redact(f"got {access}", {})
    remember(access)
    assert leaks(redact(f"got {access[3:]}", {}), access) == []


def test_shown_urls_keep_only_where_they_point():
    assert shown_url("http://u:p4ssw0rd-long@127.0.0.2:81/api/x?token=t0k3n-secret#frag") == "http://127.0.0.2:81/api/x"
    assert shown_url("http://[::1]:99/") == "http://[::1]:99/"
    assert shown_url("http://h:notaport/") == MASK


@pytest.mark.parametrize("value, safe", [("abc.DEF-123_~", True), ("a b", False), ("a\nb", False), ("tökén", False)])
def test_a_header_carries_only_visible_ascii(value, safe):
    assert header_safe(value) is safe


def test_a_redacting_stream_redacts_each_write(monkeypatch):
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    out = io.StringIO()
    stream = RedactingStream(out)
    print(f"Traceback ... {TOKEN}", file=stream)
    stream.writelines([f"{TOKEN[:12]}\n"])
    assert leaks(out.getvalue(), TOKEN) == [] and out.getvalue().count(MASK) == 2


def test_the_flow_s_errors_and_its_children_s_output_are_redacted(monkeypatch, tmp_path):
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    assert leaks(str(RetrainError(f"pull failed: {TOKEN}")), TOKEN) == []
    echoed = capture(["sh", "-c", 'echo "token $LABEL_STUDIO_API_KEY"; echo "$LABEL_STUDIO_API_KEY" >&2'], tmp_path)
    assert echoed.returncode == 0 and MASK in echoed.output and MASK in echoed.stderr
    assert leaks(echoed.output + echoed.stderr, TOKEN) == []
