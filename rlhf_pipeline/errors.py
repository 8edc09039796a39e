"""User-facing errors: one clear paragraph, a non-zero exit, no traceback."""

from __future__ import annotations


class PipelineError(Exception):
    """A problem with the user's input (file, dataset, parameter) rather than a bug.

    The message is printed as-is by the stage runner and the CLI, so it must name the file,
    key or column at fault and say what to do about it.
    """

    exit_code = 1


class ParamsError(PipelineError):
    """params.yaml failed validation; ``problems`` holds one ``dotted.key: message`` per line."""

    exit_code = 2

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = problems
        super().__init__("\n".join(problems))


class DataContractError(PipelineError):
    """Preference data failed the Great Expectations contract."""

    exit_code = 3


class NonFiniteError(PipelineError):
    """Training produced NaN/inf; the last good checkpoint is kept."""

    exit_code = 4
