"""People label: Label Studio tasks out, annotations in, as OpenAI's lm-human-preferences collected
them (a query, N responses sampled from the current model, the labeller picks the best of N).

- :func:`label_config` is the labelling interface (Label Studio XML): the query, the N responses,
  one required single choice whose exported value is the response's index.
- :func:`export_tasks` samples the N responses per query from a model folder and returns Label Studio
  tasks; each carries what ties it back: the query's split and index, the sampling seed, the model
  and its weights' SHA-256, the round, and ``task_id`` (a hash of all of them).
- :func:`fetch_export` pulls a project's JSON export from a running server (its address and API token
  from the environment, as Label Studio's own SDK reads them: never from params or files in git).
- :func:`rows_from_export` reads Label Studio's JSON export into best-of-N preference rows, one per
  annotation, with ``annotator``, ``task_id``, ``round`` and ``model``; it refuses
  (:class:`DataContractError`, exit 3, nothing written) an annotation that cannot be a label and
  reports cancelled and skipped ones, and the agreement between annotators where a task has several.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from xml.sax.saxutils import quoteattr

import torch

from rlhf_pipeline.errors import DataContractError, PipelineError, SettingsError
from rlhf_pipeline.io import read_jsonl, sha256_file
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.preferences import MAX_RESAMPLES, sample_clean_candidates, sample_problem
from rlhf_pipeline.sampling import ResponseSampler

CHOICE = "best"  # the <Choices> name: what an annotation's result is read from
URL_VARIABLE, TOKEN_VARIABLE = "LABEL_STUDIO_URL", "LABEL_STUDIO_API_KEY"  # the names Label Studio's SDK reads
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


@torch.no_grad()
def export_tasks(
    model_dir: str | Path,
    queries_dir: str | Path,
    task: TaskParams,
    split: str,
    num_queries: int,
    n: int,
    seed: int,
    round_: int,
    model_name: str | None = None,
    batch_size: int = 16,
) -> list[dict]:
    """Label Studio tasks for the first ``num_queries`` queries of ``split``: ``n`` responses each,
    sampled from ``model_dir`` with the task's sampling (as the preferences stage samples them).
    A query whose responses would break the data contract (e.g. two identical) is drawn again, up to
    :data:`MAX_RESAMPLES` times as the stage does, then left out."""
    from datasets import load_from_disk

    part = load_from_disk(str(queries_dir))[split]
    if num_queries > len(part):
        raise PipelineError(f"{queries_dir} ({split}) has {len(part)} queries; {num_queries} were asked for.")
    tokenizer = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir)).eval()
    vocabulary = model.get_input_embeddings().num_embeddings
    highest = max(max(ids) for ids in part.select(range(num_queries))["query_ids"])
    if highest >= vocabulary:  # queries another tokenizer made (another base model's project)
        raise PipelineError(
            f"{queries_dir} was tokenized for another model: its token ids reach {highest}, and {model_dir}'s "
            f"vocabulary has {vocabulary}. Export from the base model whose tokenizer made the queries (or a "
            "policy trained from it), or rerun `dvc repro queries` for this one; nothing was written."
        )
    sampler = ResponseSampler.from_tokenizer(task, tokenizer)
    generator = torch.Generator().manual_seed(seed)
    model_sha = weights_sha256(model_dir)
    name = model_name or str(model_dir)
    tasks = []
    for start in range(0, num_queries, batch_size):
        indices = list(range(start, min(start + batch_size, num_queries)))
        ids = [part[i]["query_ids"] for i in indices]
        texts = sample_clean_candidates(model, tokenizer, sampler, ids, n, generator, MAX_RESAMPLES)[0]
        for i, samples in zip(indices, texts):
            if sample_problem(samples) is not None:
                continue
            data = {
                "task_id": task_id(model_sha, split, i, seed, n, round_),
                "query": part[i]["query"],
                **{f"sample{k}": text for k, text in enumerate(samples)},
                "split": split,
                "query_index": i,
                "seed": seed,
                "model": name,
                "model_sha256": model_sha,
                "round": round_,
            }
            tasks.append({"data": data})
    return tasks


def fetch_export(
    project: int, environ: dict[str, str] | None = None, timeout_s: float = 120.0
) -> tuple[list[dict], str]:
    """(project ``project``'s annotated tasks as Label Studio's JSON export, a name for messages), pulled
    from the server at ``$LABEL_STUDIO_URL`` with the API token ``$LABEL_STUDIO_API_KEY``.

    One GET of the export endpoint: with ``httpx`` (already a dependency) rather than Label Studio's SDK,
    whose closure would move the pipeline's lock for this one call. The token is either kind Label
    Studio's Account & Settings page gives: a personal access token (a JWT refresh token, exchanged
    for an access token first) or a legacy token. It is never printed."""
    import httpx

    environ = os.environ if environ is None else environ
    missing = [name for name in (URL_VARIABLE, TOKEN_VARIABLE) if not environ.get(name)]
    if missing:
        raise SettingsError(
            f"rlhf label import --from-server reads the server's address and your API token from the environment; "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. Export {URL_VARIABLE}="
            f"http://HOST:PORT and {TOKEN_VARIABLE}=<the token on Label Studio's Account & Settings page>; they are "
            "never read from params or files, so they stay out of git."
        )
    base = environ[URL_VARIABLE].rstrip("/")
    where = f"Label Studio project {project} at {base}"
    refused = (
        f"{where} refused the token in {TOKEN_VARIABLE} (HTTP {{}}): use a token from Label Studio's Account & "
        "Settings page (a personal access token, or a legacy token where the organisation enables them); "
        "nothing written."
    )
    try:
        with httpx.Client(base_url=base, timeout=timeout_s) as client:
            token = environ[TOKEN_VARIABLE]
            authorization = f"Token {token}"
            if token.count(".") == 2:  # a personal access token: a JWT refresh token, exchanged for an access token
                exchanged = client.post("/api/token/refresh", json={"refresh": token})
                if exchanged.status_code != 200:
                    raise SettingsError(refused.format(exchanged.status_code))
                authorization = f"Bearer {exchanged.json()['access']}"
            response = client.get(
                f"/api/projects/{project}/export",
                params={"exportType": "JSON", "download_all_tasks": "false"},
                headers={"Authorization": authorization},
            )
    except httpx.HTTPError as error:
        raise PipelineError(  # exit 1: the retrain flow retries it (a server restarting)
            f"{where}: the server did not answer ({type(error).__name__}: {error}); nothing written."
        ) from None
    if response.status_code in (401, 403):
        raise SettingsError(refused.format(response.status_code))
    if response.status_code == 404:
        raise SettingsError(f"{where}: no such project (HTTP 404); its id is the number in the project's URL.")
    if response.status_code != 200:
        raise PipelineError(f"{where} answered HTTP {response.status_code}: {response.text[:300]}; nothing written.")
    try:
        tasks = response.json()
    except ValueError:
        raise PipelineError(f"{where} answered something that is not JSON ({response.text[:200]!r}).") from None
    if not isinstance(tasks, list):
        raise DataContractError(f"{where}: the export is not a list of tasks ({type(tasks).__name__}).")
    return tasks, where


@dataclass
class ImportReport:
    rows: list[dict]
    annotations: int = 0
    cancelled: int = 0
    skipped: int = 0  # submitted without a choice
    tasks: int = 0
    tasks_with_several: int = 0
    agreement: float | None = None  # share of annotator pairs on one task that chose the same response
    annotators: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        return {
            "rows": len(self.rows),
            "tasks": self.tasks,
            "annotations": self.annotations,
            "cancelled": self.cancelled,
            "skipped": self.skipped,
            "annotators": dict(sorted(self.annotators.items())),
            "tasks_with_several_annotations": self.tasks_with_several,
            "agreement": self.agreement,
        }


def _annotator(annotation: dict) -> str:
    who = annotation.get("completed_by")
    if isinstance(who, dict):  # some exports expand the user
        who = who.get("email") or who.get("id")
    return str(who)


def _choice(annotation: dict) -> list[str] | None:
    """The values chosen in ``annotation``'s result for :data:`CHOICE` (None: no choice made)."""
    for item in annotation.get("result") or []:
        if item.get("from_name") == CHOICE and item.get("type") == "choices":
            return list((item.get("value") or {}).get("choices") or [])
    return None


def rows_from_export(tasks: list[dict], where: str, min_agreement: float | None = None) -> ImportReport:
    """Best-of-N rows from Label Studio's JSON export ``tasks`` (see the module docstring)."""
    report = ImportReport(rows=[])
    choices_by_task: dict[str, list[int]] = {}
    for position, item in enumerate(tasks):
        data = item.get("data") or {}
        label = f"{where}: task {item.get('id', position)}"
        missing = [k for k in (*TASK_FIELDS, "sample0", "sample1") if k not in data]
        if missing:
            raise DataContractError(
                f"{label} lacks {', '.join(missing)} in its data: it was not made by `rlhf label export` (or its "
                "fields were edited). Export tasks with `rlhf label export` and import them into the project."
            )
        n = sum(1 for k in data if k.startswith("sample") and k[6:].isdigit())
        seen: set[str] = set()
        report.tasks += 1
        for annotation in item.get("annotations") or []:
            report.annotations += 1
            best = _label(annotation, data, n, f"{label} (task_id {data['task_id']})", seen, report)
            if best is None:
                continue
            choices_by_task.setdefault(data["task_id"], []).append(best)
            report.rows.append(_row(data, n, best, _annotator(annotation)))
    report.agreement, report.tasks_with_several = pairwise_agreement(choices_by_task)
    if min_agreement is not None and report.agreement is not None and report.agreement < min_agreement:
        worst = [t for t, c in choices_by_task.items() if len(set(c)) > 1][:5]
        raise DataContractError(
            f"{where}: annotators agree on {report.agreement:.2f} of the pairs that labelled one task "
            f"({report.tasks_with_several} tasks with several annotations), below min_agreement {min_agreement:g}. "
            f"Tasks they split on: {', '.join(worst)}. Review the instructions or the annotators; nothing was written."
        )
    return report


def _label(annotation: dict, data: dict, n: int, task_label: str, seen: set[str], report: ImportReport) -> int | None:
    """The response ``annotation`` chose (None for a cancelled or empty one, counted in ``report``);
    refuses a choice outside the ``n`` responses and a second answer by one annotator (``seen``)."""
    who = _annotator(annotation)
    where = f"{task_label}, annotation {annotation.get('id')} by annotator {who}"
    if annotation.get("was_cancelled"):
        report.cancelled += 1
        return None
    chosen = _choice(annotation)
    if not chosen:
        report.skipped += 1
        return None
    if len(chosen) != 1 or not chosen[0].isdigit() or not 0 <= int(chosen[0]) < n:
        raise DataContractError(
            f"{where}: the choice {chosen} is not one of the {n} responses (0 to {n - 1}); the project's labelling "
            "interface must be the one `rlhf label config` writes. Nothing was written."
        )
    if who in seen:
        raise DataContractError(
            f"{where}: this annotator answered the task twice; keep one of the two annotations in Label Studio "
            "(delete the other) and export again. Nothing was written."
        )
    seen.add(who)
    report.annotators[who] += 1
    return int(chosen[0])


def _row(data: dict, n: int, best: int, annotator: str) -> dict:
    """One best-of-N preference row, with where it came from."""
    return {
        "query": data["query"],
        **{f"sample{k}": data[f"sample{k}"] for k in range(n)},
        "best": best,
        # not `split`: the preferences stage holds out its own seeded share of the labels
        "query_split": data["split"],
        "annotator": annotator,
        "task_id": data["task_id"],
        "round": int(data["round"]),
        "model": data["model"],
        "model_sha256": data["model_sha256"],
        "seed": int(data["seed"]),
        "query_index": int(data["query_index"]),
    }


def pairwise_agreement(choices_by_task: dict[str, list[int]]) -> tuple[float | None, int]:
    """(share of the pairs of annotations of one task that chose the same response, tasks with >= 2);
    None when no task has two annotations."""
    pairs = agreeing = tasks = 0
    for choices in choices_by_task.values():
        if len(choices) < 2:
            continue
        tasks += 1
        for a, b in combinations(choices, 2):
            pairs += 1
            agreeing += a == b
    return (agreeing / pairs if pairs else None), tasks


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines label file, read (and refused, exit 3) as every preference file is
    (:func:`rlhf_pipeline.io.read_jsonl`); a key a row lacks stays absent, not NaN."""
    columns = read_jsonl(Path(path))
    names = list(columns)
    return [
        {k: v for k, v in zip(names, values) if not (isinstance(v, float) and math.isnan(v))}
        for values in zip(*columns.values())
    ]


def merge_rounds(existing: list[dict], new: list[dict], where: str) -> tuple[list[dict], int, int]:
    """Every round's labels in one file: ``existing`` rows, then the ``new`` rows whose (task_id,
    annotator) is not there yet. Importing the same export again adds nothing; an annotation that
    disagrees with the one already kept for its task and annotator is refused (exit 3), since one of
    the two exports was edited. Returns (rows, added, already there)."""
    kept = {(row.get("task_id"), row.get("annotator")): row for row in existing}
    added, repeated = [], 0
    for row in new:
        key = (row["task_id"], row["annotator"])
        if key in kept:
            if kept[key]["best"] != row["best"]:
                raise DataContractError(
                    f"{where}: task_id {key[0]} by annotator {key[1]} is already labelled {kept[key]['best']} "
                    f"(round {kept[key].get('round')}), and this export says {row['best']}. One of the two exports was "
                    "changed after the labels were taken; nothing was written."
                )
            repeated += 1
            continue
        kept[key] = row
        added.append(row)
    return [*existing, *added], len(added), repeated
