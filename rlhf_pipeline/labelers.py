"""Simulated labelers: programmatic "gold" scores that stand in for human preference labels.

lm-human-preferences asked humans which of four continuations was best. Without humans, the
``preferences`` stage scores each candidate with a :class:`Labeler` and picks the best one from
those scores. The labeler is the *gold* reward; the reward model only ever sees its choices.

Add a labeler by subclassing :class:`Labeler` and registering it in ``LABELERS`` (and in the
``Literal`` of ``data.preferences.labeler`` in ``rlhf_pipeline/params/data.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.params.data import SIMULATED


class Labeler(ABC):
    """Scores texts; higher is better. Must be deterministic for a given input."""

    name: str = ""

    @abstractmethod
    def score(self, texts: list[str]) -> list[float]:
        """One float per text, in order."""


class VaderLabeler(Labeler):
    """Positive sentiment: VADER's compound score in [-1, 1] (the reference's sentiment task
    asked labelers for the most positive continuation)."""

    name = "vader"

    def __init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._analyzer = SentimentIntensityAnalyzer()

    def score(self, texts: list[str]) -> list[float]:
        return [float(self._analyzer.polarity_scores(text)["compound"]) for text in texts]


LABELERS: dict[str, Callable[[], Labeler]] = {"vader": VaderLabeler}


def get_labeler(name: str) -> Labeler:
    """The registered labeler called ``name`` (``data.preferences.labeler``)."""
    try:
        factory = LABELERS[name]
    except KeyError:
        raise PipelineError(
            f"data.preferences.labeler: unknown labeler {name!r}; known: {', '.join(sorted(LABELERS))}."
        ) from None
    return factory()


def gold_labeler(source: str, name: str) -> Labeler | None:
    """The gold score of the run: the labeler ``name`` when the labels are simulated
    (``data.preferences.source``), None for user labels, which come with no gold score."""
    return get_labeler(name) if source == SIMULATED else None
