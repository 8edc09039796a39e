"""Label Studio's side of a best-of-N task, as OpenAI's lm-human-preferences collected them (a query, N
responses sampled from the current model, the labeller picks the best of N): the labelling interface
(:func:`label_config`, Label Studio XML: the query, the N responses, one required single choice whose exported
value is the response's index), the fields each task carries back (:data:`TASK_FIELDS`), its id
(:func:`task_id`) and the weights it was sampled from (:func:`weights_sha256`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from xml.sax.saxutils import quoteattr

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import sha256_file

CHOICE = "best"  # the <Choices> name: what an annotation's result is read from
TASK_FIELDS = ("task_id", "query", "split", "query_index", "seed", "model", "model_sha256", "round")


def label_config(n: int) -> str:
    """Label Studio's labelling interface for best-of-``n`` (n = 2: pairwise): the query, each response
    under its number, and one required choice whose value (its ``alias``) is the response's index."""
    if n < 2:
        raise PipelineError(f"a labelling task needs at least 2 responses to choose from (got {n}).")
    lines = [
        "<View>",
        '  <Header value="Query"/>',
        '  <Text name="query" value="$query"/>',
        f'  <Header value="Which response continues it best? Pick one of the {n}."/>',
    ]
    for i in range(n):
        lines += [f'  <Header value="Response {i + 1}" size="5"/>', f'  <Text name="sample{i}" value="$sample{i}"/>']
    lines.append(f'  <Choices name="{CHOICE}" toName="query" choice="single" required="true" showInLine="true">')
    for i in range(n):
        lines.append(f"    <Choice value={quoteattr(f'Response {i + 1}')} alias={quoteattr(str(i))}/>")
    lines += ["  </Choices>", "</View>", ""]
    return "\n".join(lines)


def task_id(model_sha256: str, split: str, query_index: int, seed: int, n: int, round_: int) -> str:
    """The id that ties a task to what made it: the same inputs give the same id (deduplication)."""
    key = json.dumps([model_sha256, split, query_index, seed, n, round_])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 of the model's weight files, in name order (which weights sampled the responses)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise PipelineError(f"{model_dir}: no *.safetensors weights; give a model folder (models/base, models/policy).")
    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()
