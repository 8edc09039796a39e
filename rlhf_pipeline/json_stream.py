"""A JSON array read one element at a time: a Label Studio export of any size (a file typed by hand,
or the server's answer spooled to disk) is parsed in memory bounded by its largest element, never
loaded whole.

Each element is parsed by the standard library's decoder as soon as its closing bracket is in the
buffer; an element larger than ``max_element_chars``, or nested deeper than the decoder's recursion
allows, is refused with the element's position instead of growing the buffer or the stack.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from rlhf_pipeline.errors import DataContractError

CHUNK_CHARS = 1 << 20
_WHITESPACE = " \t\n\r"


class _Buffer:
    """The text read so far from ``read``, from the first character not yet consumed."""

    def __init__(self, read: Callable[[int], str]):
        self.read, self.text, self.pos, self.eof = read, "", 0, False

    def more(self) -> bool:
        """Read another chunk (dropping what was consumed), as long as what is held: an element that
        spans many chunks is then parsed O(log n) times, not once a chunk. False at the end of the input."""
        if self.eof:
            return False
        chunk = self.read(max(CHUNK_CHARS, len(self.text) - self.pos))
        self.text = self.text[self.pos :] + chunk
        self.pos = 0
        self.eof = not chunk
        return bool(chunk)

    def next_char(self) -> str:
        """The next character that is not whitespace ('' at the end), not consumed."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""


def iter_json_array(
    read: Callable[[int], str], where: str, max_element_chars: int = 64 << 20
) -> Iterator[tuple[int, Any]]:
    """``(position, element)`` of the JSON array that ``read`` (a text file's ``read``) holds;
    :class:`DataContractError` (exit 3) naming ``where`` and the element's position when the text is
    not one array, an element is over ``max_element_chars`` characters, or nests too deep to parse."""
    decoder = json.JSONDecoder()
    buffer = _Buffer(read)
    first = buffer.next_char()
    if first != "[":
        shown = "nothing" if not first else repr(buffer.text[buffer.pos : buffer.pos + 40])
        raise DataContractError(f"{where}: a Label Studio JSON export is one list of tasks; it starts with {shown}.")
    buffer.pos += 1
    position = 0
    if buffer.next_char() == "]":
        buffer.pos += 1
        _expect_end(buffer, where)
        return
    while True:
        buffer.next_char()
        element = _element(decoder, buffer, where, position, max_element_chars)
        yield position, element
        position += 1
        separator = buffer.next_char()
        buffer.pos += 1
        if separator == "]":
            _expect_end(buffer, where)
            return
        if separator != ",":
            raise DataContractError(
                f"{where}: after task {position - 1} comes {separator or 'the end of the file'!r}, not ',' or ']': "
                "the export is cut short or is not JSON. Nothing was written."
            )


def _element(decoder: json.JSONDecoder, buffer: _Buffer, where: str, position: int, limit: int) -> Any:
    """The element starting at the buffer's position, reading more until it is complete."""
    while True:
        try:
            value, end = decoder.raw_decode(buffer.text, buffer.pos)
        except RecursionError:
            raise DataContractError(
                f"{where}: task {position} nests deeper than a JSON parser follows (thousands of levels); no export "
                "of Label Studio does. Nothing was written."
            ) from None
        except json.JSONDecodeError as error:
            if buffer.eof or len(buffer.text) - buffer.pos > limit:
                raise _refusal(where, position, limit, buffer, error) from None
            buffer.more()
            continue
        if end == len(buffer.text) and not buffer.eof:  # a number or literal may go on in the next chunk
            buffer.more()
            continue
        if end - buffer.pos > limit:
            raise _refusal(where, position, limit, buffer, None)
        buffer.pos = end
        return value


def _refusal(where: str, position: int, limit: int, buffer: _Buffer, error: json.JSONDecodeError | None):
    if error is None or len(buffer.text) - buffer.pos > limit:
        return DataContractError(
            f"{where}: task {position} is over {limit:,} characters; a labelling task is a query and a few "
            "responses. Nothing was written."
        )
    return DataContractError(f"{where}: task {position} is not valid JSON ({error.msg}). Nothing was written.")


def _expect_end(buffer: _Buffer, where: str) -> None:
    if (rest := buffer.next_char()) != "":
        raise DataContractError(
            f"{where}: text follows the list of tasks (from {rest!r}): the export holds more than one JSON value. "
            "Nothing was written."
        )
