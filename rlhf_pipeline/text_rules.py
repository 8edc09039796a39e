"""The data contract's text rules, in one home: which texts of the preference data are refused
(empty, invisible-only, holding control or bidirectional-override characters). The loaders, the
simulated labeller, the contract and the labelling import all ask :func:`text_problem`."""

from __future__ import annotations

import re

# Characters the data contract refuses: C0/C1 control characters other than \t and \n, DEL, the
# bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069: they reorder how
# the text around them displays, so a reviewer reads other text than the model gets), and the marks
# of invalid UTF-8: U+FFFD (what undecodable bytes become) and lone surrogates.
BAD_CHARACTERS = r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff\ufffd]"
_BAD_CHARACTERS_RE = re.compile(BAD_CHARACTERS)
# A text must hold at least one character that shows: not whitespace and not a format character
# that renders as nothing (soft hyphen, zero-width space/joiners, directional marks, word joiner,
# BOM), so a row of only U+200B is as empty as a row of spaces.
INVISIBLE_CHARACTERS = r"\u00ad\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u206a-\u206f\ufeff"
VISIBLE_CHARACTER = rf"[^\s{INVISIBLE_CHARACTERS}]"
_VISIBLE_CHARACTER_RE = re.compile(VISIBLE_CHARACTER)
# The contract's two text checks, by the names its report gives them.
EMPTY_TEXT_CHECK = "no empty, whitespace-only or invisible-only text"
BAD_CHARACTER_CHECK = "no invalid UTF-8, control or bidirectional-override characters"


def text_problem(text: str) -> str | None:
    """The contract check ``text`` fails (:data:`EMPTY_TEXT_CHECK`, :data:`BAD_CHARACTER_CHECK`), or None.

    The one statement of the rule every text obeys: the contract runs these two regexes as its
    Great Expectations text checks; the preferences stage (on a user's file) and the simulated
    labeller (on its samples) call this, so nothing one accepts the other refuses."""
    if not _VISIBLE_CHARACTER_RE.search(text):
        return EMPTY_TEXT_CHECK
    if _BAD_CHARACTERS_RE.search(text):
        return BAD_CHARACTER_CHECK
    return None
