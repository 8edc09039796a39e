"""The ``params.yaml`` schema, one pydantic module per section of the file, and how it is read.

Each section lives in its own module (``params.base_model``, ``.data``, ``.task``, ``.reward``,
``.ppo``, ``.evaluate``, ``.schedule``); :mod:`rlhf_pipeline.params.schema` joins them into the
whole file's :class:`~rlhf_pipeline.params.schema.Params`. A stage imports only the sections it
reads, so a new field in one section makes DVC rerun only the stages that read that section
(each stage's code dependencies in ``dvc.yaml`` are the modules it imports).

This module holds what every section shares: the :class:`Strict` base model, the YAML reader
(:func:`read_params_file`), :func:`validate` and the one-line-per-problem rendering of errors.

Defaults are the lm-human-preferences reference values (Ziegler et al. 2019, sentiment task, as
reproduced in lm-human-preference-details) wherever one applies. ``params.yaml`` ships the CPU
profile, which overrides counts, batch sizes and a few learning-speed knobs so the whole pipeline
fits in about 15 minutes on 2 cores; every override is commented there.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlhf_pipeline.errors import ParamsError
from rlhf_pipeline.io import NotUTF8Error, decode_utf8, nesting_depth

Seed = Annotated[int, Field(ge=0, le=2**32 - 1, description="numpy's seeds are 32-bit.")]

# Upper bounds for sizes and counts: far above anything this pipeline trains (a user can reach them
# on purpose), far below what would exhaust memory or run for ever by a typo (1e12 passages).
MAX_TOKENS = 131_072  # a length in tokens: the longest context of current open models
MAX_BATCH = 65_536  # rows in one batch
MAX_ROWS = 100_000_000  # rows, labels, episodes, samples over a whole run
MAX_SMALL = 10_000  # epochs, samples per query, layers, ranks, table rows
MAX_DEPTH = 16  # how deep a params file may nest (params.yaml itself: 4 levels)
Model = TypeVar("Model", bound=BaseModel)
# keys that moved: a params file written for an older version is told where the key lives now
MOVED_KEYS = {
    "ppo.device": "compute.device (one device rule for every stage that runs a model)",
    "labelling.labels_file": "data.preferences.source (one key names the labels file: the one the stages read "
    "and a run brings labels into); delete it here",
}


class Strict(BaseModel):
    """Unknown keys are refused: a typo in params.yaml must not silently fall back to a default.
    So are .inf and .nan: no parameter of this pipeline means anything when not finite. Types are
    strict: ``true`` is not the number 1, ``"24"`` is not a length."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)


class KeyProblems:
    """Problems that a section's cross-field validator finds, each naming its own key (relative to
    the section the validator belongs to), carried through pydantic's ValueError wrapping so that
    the message names the real key path rather than the section."""

    def __init__(self, problems: list[tuple[str, str, Any]]):
        self.problems = problems

    def __str__(self) -> str:
        return "; ".join(f"{k}: {m} (got {v!r})" for k, m, v in self.problems)


def refuse(problems: list[tuple[str, str, Any]]) -> None:
    """Raise the ``(key, message, value)`` problems of a ``model_validator``, if any."""
    if problems:
        raise ValueError(KeyProblems(problems))


def format_validation_error(error: ValidationError) -> list[str]:
    """One ``dotted.key: message (got X)`` line per problem."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        ctx_error = (item.get("ctx") or {}).get("error")
        payload = ctx_error.args[0] if isinstance(ctx_error, ValueError) and ctx_error.args else ctx_error
        if isinstance(payload, KeyProblems):
            lines.extend(f"{where + '.' if where else ''}{k}: {m} (got {v!r})" for k, m, v in payload.problems)
            continue
        message = item["msg"]
        if item["type"] == "extra_forbidden" and where in MOVED_KEYS:
            message = f"this key moved to {MOVED_KEYS[where]}; set it there"
        elif item["type"] == "extra_forbidden":  # each section's schema is the module of its name
            module = f"params/{item['loc'][0]}.py" if len(item["loc"]) > 1 else "params/schema.py"
            message = f"unknown key (typo? see params.yaml and rlhf_pipeline/{module})"
        got = item.get("input")
        if isinstance(got, dict):
            got = "a mapping"
        lines.append(f"{where or '<root>'}: {message} (got {got!r})")
    return lines


def validate(schema: type[Model], raw: Any, path: str = "params.yaml") -> Model:
    """``raw`` (a parsed params file, or the part of it ``schema`` covers) validated by ``schema``,
    or a :class:`ParamsError` listing every problem with its key path."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(path, [f"<root>: must be a mapping of stage sections (got {type(raw).__name__})"])
    try:
        return schema.model_validate(raw)
    except ValidationError as error:
        raise ParamsError(path, format_validation_error(error)) from None


class _StrictLoader(yaml.SafeLoader):
    """YAML as DVC reads params.yaml, minus what would make the two disagree or hang: a key given
    twice (PyYAML keeps the last, DVC refuses the file) and aliases (an alias bomb expands
    exponentially; a params file has no use for them)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, f"uses the alias *{event.anchor}; aliases are not allowed here", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader itself refuses it, with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_params_file(path: str | os.PathLike = "params.yaml") -> Any:
    """The raw YAML of ``path``, or a :class:`ParamsError` naming what is wrong with the file."""
    path = Path(path)
    if path.is_dir():
        raise ParamsError(str(path), [f"<file>: {path} is a folder; give a params file (params.yaml, or a profile)"])
    if not path.is_file():
        raise ParamsError(str(path), [f"<file>: {path} not found (run from the project root, or pass a path)"])
    data = path.read_bytes()
    try:
        text = decode_utf8(path, data)
    except NotUTF8Error as error:
        raise ParamsError(str(path), [f"<file>: {error}; save it as UTF-8"]) from None
    too_deep = f"<file>: {path} nests values more than {MAX_DEPTH} levels deep (params.yaml needs 4)"
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        raise ParamsError(str(path), [f"<file>: {path} is not valid YAML: {error}".replace("\n", " ")]) from None
    except RecursionError:  # the YAML composer recurses once per level
        raise ParamsError(str(path), [too_deep]) from None
    if nesting_depth(raw, MAX_DEPTH) > MAX_DEPTH:
        raise ParamsError(str(path), [too_deep])
    return raw


class StageParams(Strict):
    """The base of a stage's own schema: the root ``seed`` plus the sections the stage declares
    as fields (``task: TaskParams = TaskParams()``...). The stage runner validates just those
    sections of params.yaml with it, so the stage's code depends on those section modules only."""

    seed: Seed = 1
