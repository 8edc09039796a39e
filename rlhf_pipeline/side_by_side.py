"""Side-by-side human evaluation of two policies: both answer the same held-out queries, people say
which answer is better without being told whose it is, and the promotion gate reads their verdicts
(``promotion.score: human``), as OpenAI judged its policies and as Chatbot Arena ranks models.

- :func:`label_config` is the labelling interface: the query, Response A and Response B, and one
  required choice: A, B or tie.
- :func:`rlhf_pipeline.side_by_side_sampling.sample_round` samples one response from each model on
  the first held-out queries (the same queries, the same seed for both) and returns the Label Studio
  tasks and the :class:`Round` that keeps what the tasks do not say: which model wrote A, drawn at
  random for each task. A task carries the two versions (in name order), their weights' SHA-256, the
  query, its index and the seed, and nothing that tells which model wrote which response.
- :func:`read_verdicts` reads Label Studio's export of those tasks back (one answer per task and
  annotator, as the best-of-N import checks it) into each task's round as verdicts: challenger,
  incumbent or tie, by annotator.
- :func:`tally` counts a round's verdicts for the gate (:class:`rlhf_pipeline.promotion.Tally`: the
  challenger's win rate, a tie counting ``tie_weight`` of a win, its Wilson interval, each person's share).

A round lives in ``side_by_side/<challenger>_vs_<incumbent>.json`` (:func:`round_path`): the order key
written when the tasks are, the verdicts added by each import; the gate commits it with its decision.
This module reads, writes and counts rounds without torch; sampling one is in ``side_by_side_sampling``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.sax.saxutils import quoteattr

from rlhf_pipeline.errors import DataContractError, SettingsError, plain, quoted
from rlhf_pipeline.file_lock import held
from rlhf_pipeline.gitrepo import commit_staged, git
from rlhf_pipeline.io import atomic_file
from rlhf_pipeline.label_studio.export import answered_choice, pairwise_agreement, read_export, task_annotations
from rlhf_pipeline.params.labelling import LabellingParams
from rlhf_pipeline.project_key import project_key, seal, seal_agrees
from rlhf_pipeline.promotion import Tally
from rlhf_pipeline.text_rules import text_problem

# the rounds' folder, in the project's root: the gate's, not a stage's (no stage reads or writes it, so it
# is not in rlhf_pipeline/paths.py, whose every edit makes every stage stale)
ROUNDS = "side_by_side"
CHALLENGER, INCUMBENT, TIE = "challenger", "incumbent", "tie"
CHOICES = {"A": "a", "B": "b", "tie": TIE}  # what the page shows -> the value an annotation exports
TASK_FIELDS = ("task_id", "comparison", "query", "response_a", "response_b", "versions", "sha256", "split")
INTEGER_FIELDS = {"query_index": 2**31, "seed": 2**32}
_HEX = frozenset("0123456789abcdef")


def label_config() -> str:
    """Label Studio's interface for a side-by-side task: the query, the two responses, one required
    choice whose exported value is ``a``, ``b`` or ``tie``."""
    lines = [
        "<View>",
        '  <Header value="Query"/>',
        '  <Text name="query" value="$query"/>',
        '  <Header value="Which response continues it better? Choose tie when neither is."/>',
        '  <Header value="Response A" size="5"/>',
        '  <Text name="response_a" value="$response_a"/>',
        '  <Header value="Response B" size="5"/>',
        '  <Text name="response_b" value="$response_b"/>',
        '  <Choices name="best" toName="query" choice="single" required="true" showInLine="true">',
    ]
    lines += [f"    <Choice value={quoteattr(shown)} alias={quoteattr(value)}/>" for shown, value in CHOICES.items()]
    lines += ["  </Choices>", "</View>", ""]
    return "\n".join(lines)


def comparison_name(challenger: str, incumbent: str) -> str:
    """``policy@v2.0.0_vs_policy@v1.0.0``: a round's name (a folder's slashes become dashes)."""
    return f"{challenger}_vs_{incumbent}".replace("/", "-")


def round_path(root: str | Path, challenger: str, incumbent: str) -> Path:
    return Path(root, ROUNDS, f"{comparison_name(challenger, incumbent)}.json")


@dataclass
class Round:
    """One side-by-side comparison: the two models, and per task the order the page showed them in."""

    challenger: str  # a registered version's tag, or a folder
    challenger_sha256: str
    incumbent: str
    incumbent_sha256: str
    seed: int
    split: str
    created: str
    order: dict[str, str]  # task_id -> which model wrote Response A (challenger | incumbent)
    queries: dict[str, int]  # task_id -> the query's index in the split
    verdicts: list[dict] = field(default_factory=list)  # {task_id, query_index, annotator (a pseudonym), winner}
    seal: str = ""  # the project key's digest of everything above (rlhf_pipeline.project_key.seal)

    @property
    def name(self) -> str:
        return comparison_name(self.challenger, self.incumbent)

    def content(self) -> dict:
        """What the seal covers: every field but the seal."""
        return {k: v for k, v in asdict(self).items() if k != "seal"}

    def save(self, root: str | Path) -> Path:
        """Write the round, sealed with the project's key (callers hold the rounds' lock, :func:`rounds_lock`)."""
        path = round_path(root, self.challenger, self.incumbent)
        self.seal = seal(self.content(), project_key(root))
        with atomic_file(path) as out:
            json.dump(asdict(self), out, indent=1, sort_keys=True)
            out.write("\n")
        return path


def rounds_lock(root: str | Path):
    """The lock every writer of ``root``'s round files holds across its read, merge and write."""
    return held(Path(root, ROUNDS))


def commit_round(root: Path, path: Path) -> None:
    """Commit a side-by-side round file as it stands (the order key, the verdicts): a decision people
    made is audited like the version it decides on. Nothing to commit: nothing done."""
    relative = str(path.relative_to(root))
    if not (git(str(root), "status", "--porcelain", "--", relative) or "").strip():
        return
    git(str(root), "add", "--", relative)
    commit_staged(root, [relative], f"side-by-side round {path.stem}")


def refuse_existing_round(root: str | Path, challenger: str, incumbent: str) -> None:
    """A round is sampled once: a second would replace the first's order key and the verdicts given."""
    path = round_path(root, challenger, incumbent)
    if path.exists():
        raise SettingsError(
            f"{path.relative_to(root) if Path(root) in path.parents else path} exists: {challenger} was already "
            f"compared with {incumbent}, and people's verdicts go into that round. Import them with `rlhf label "
            "verdicts`; to start over, remove the round (`git rm` it) first. Nothing was written."
        )


def load_round(path: str | Path, root: str | Path | None = None) -> Round:
    """A round file, refused (exit 3, the first problems named) when it is not one this project wrote
    as it was written: its seal (the project key's digest, :mod:`rlhf_pipeline.project_key`) must agree,
    and every verdict must be one person's one answer to a task of the round (:func:`round_problems`).
    ``root``: the project (default: the folder above ``side_by_side/``)."""
    path = Path(path)
    root = path.resolve().parents[1] if root is None else Path(root)
    fix = (
        f"Restore it from git (`git checkout -- {ROUNDS}/{path.name}`), or remove it and sample the round again; "
        "the gate counts nothing from it."
    )
    try:
        payload = json.loads(path.read_text())
        record = Round(**payload) if isinstance(payload, dict) else None
    except (OSError, ValueError, TypeError) as error:
        raise DataContractError(
            f"{path}: not a side-by-side round ({type(error).__name__}: {plain(str(error), 200)}); it is written by "
            f"`rlhf label compare` or the gate. {fix}"
        ) from None
    if record is None:
        raise DataContractError(f"{path}: not a side-by-side round (not a JSON object). {fix}")
    problems = round_problems(record)
    if not seal_agrees(record.content(), project_key(root, create=False), record.seal):
        found = f" What does not hold: {'; '.join(problems[:3])}." if problems else ""
        raise DataContractError(
            f"{path}: its seal does not agree with its content: the file was edited after `rlhf label compare`, "
            f"`rlhf label verdicts` or the gate wrote it (or it was written with another project's key).{found} {fix}"
        )
    if problems:  # sealed by one who holds the key, or a bug: checked all the same
        raise DataContractError(f"{path}: {'; '.join(problems[:4])}. {fix}")
    return record


def round_problems(record: Round) -> list[str]:
    """What makes ``record`` not a round this module wrote, each naming the field or the task: every
    task's id is the one its query index and both models' SHA-256 give (:func:`task_id`), and each
    verdict is one person's only answer to one of those tasks, at its query index."""
    problems = []
    for name in ("challenger", "incumbent", "created", "split"):
        value = getattr(record, name)
        if not (isinstance(value, str) and value.isprintable() and 0 < len(value) <= 1024):
            problems.append(f"{name} is not a printable text")
    for name in ("challenger_sha256", "incumbent_sha256"):
        value = getattr(record, name)
        if not (isinstance(value, str) and len(value) == 64 and set(value) <= _HEX):
            problems.append(f"{name} is not 64 hexadecimal digits")
    if not (isinstance(record.seed, int) and not isinstance(record.seed, bool) and 0 <= record.seed < 2**32):
        problems.append("seed is not a whole number")
    if not (isinstance(record.order, dict) and isinstance(record.queries, dict) and isinstance(record.verdicts, list)):
        return [*problems, "order, queries and verdicts are not the objects and list the round writes"]
    if problems:
        return problems
    if set(record.order) != set(record.queries):
        problems.append("order and queries name different tasks")
    shas = [record.challenger_sha256, record.incumbent_sha256]
    for tid, index in record.queries.items():
        valid = isinstance(index, int) and not isinstance(index, bool) and 0 <= index < 2**31
        if not valid or tid != task_id(record.name, shas, record.split, index, record.seed):
            problems.append(f"task {plain(str(tid), 40)} is not the task of its query index and the two models")
        elif record.order.get(tid) not in (CHALLENGER, INCUMBENT):
            problems.append(f"task {plain(str(tid), 40)}'s Response A is not the challenger's or the incumbent's")
    answered: set[tuple[str, str]] = set()
    for position, verdict in enumerate(record.verdicts):
        problem = _verdict_problem(verdict, record, answered)
        if problem is not None:
            problems.append(f"verdict {position} {problem}")
    return problems


VERDICT_FIELDS = {"task_id", "query_index", "annotator", "winner"}


def _verdict_problem(verdict, record: Round, answered: set[tuple[str, str]]) -> str | None:
    """Why ``verdict`` is not a person's one answer to a task of ``record`` (None: it is); adds it to ``answered``."""
    if not isinstance(verdict, dict) or set(verdict) != VERDICT_FIELDS:
        return f"is not an object of {', '.join(sorted(VERDICT_FIELDS))}"
    tid, who = verdict["task_id"], verdict["annotator"]
    if not isinstance(tid, str) or tid not in record.queries:
        return f"answers task {plain(str(tid), 40)}, which the round did not make"
    if verdict["query_index"] != record.queries[tid] or isinstance(verdict["query_index"], bool):
        return f"(task {tid}) gives another query index than the round's"
    if verdict["winner"] not in (CHALLENGER, INCUMBENT, TIE):
        return f"(task {tid}) names no winner (challenger, incumbent or tie)"
    if not (isinstance(who, str) and who.isprintable() and 0 < len(who) <= 256):
        return f"(task {tid}) names no annotator"
    if (tid, who) in answered:
        return f"(task {tid}) is a second answer by annotator {plain(who, 80)}; one person answers a task once"
    answered.add((tid, who))
    return None


def task_id(name: str, shas: list[str], split: str, query_index: int, seed: int) -> str:
    key = json.dumps([name, sorted(shas), split, query_index, seed])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class VerdictReport:
    """What an import of side-by-side answers read (per round: the verdicts added)."""

    added: Counter = field(default_factory=Counter)  # round name -> new verdicts
    already_there: int = 0
    annotations: int = 0
    cancelled: int = 0
    skipped: int = 0
    agreement: float | None = None
    tasks_with_several: int = 0

    def summary(self) -> dict:
        return {
            "added": dict(self.added),
            "already_there": self.already_there,
            "annotations": self.annotations,
            "cancelled": self.cancelled,
            "skipped": self.skipped,
            "agreement": self.agreement,
            "tasks_with_several_annotations": self.tasks_with_several,
        }


def _task_data(item, position: int, where: str, rounds: dict[str, Round]) -> tuple[dict, str, Round]:
    """(data, label, its round) of one exported side-by-side task, checked field by field."""
    if not isinstance(item, dict) or not isinstance(item.get("data"), dict):
        raise DataContractError(
            f"{where}: task {position} has no data object: it was not made by `rlhf label compare`."
        )
    data, label = item["data"], f"{where}: task {plain(str(item.get('id', position)), 40)}"
    missing = [k for k in (*TASK_FIELDS, *INTEGER_FIELDS) if k not in data]
    if missing:
        raise DataContractError(
            f"{label} lacks {', '.join(missing)} in its data: it is not a side-by-side task of `rlhf label compare` "
            "(a best-of-N task goes to `rlhf label import`). Nothing was written."
        )
    problems = []
    for name, bound in INTEGER_FIELDS.items():
        value = data[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
            problems.append(f"{name} is {quoted(str(value), 40)}, not a whole number from 0 to {bound - 1:,}")
    for name in ("query", "response_a", "response_b"):
        value = data[name]
        problem = text_problem(value) if isinstance(value, str) else "not a text"
        if problem is not None:
            problems.append(f"{name} fails the contract's text rule ({problem})")
    record = rounds.get(data["comparison"]) if isinstance(data["comparison"], str) else None
    if record is None:
        problems.append(
            f"its comparison {quoted(str(data['comparison']), 120)} has no round file in {ROUNDS}/ "
            "(the order of its two responses is kept there, written when the tasks were)"
        )
    elif not isinstance(data["task_id"], str) or data["task_id"] not in record.order:
        problems.append(f"its task_id is not one of {record.name}'s tasks")
    elif (
        not (isinstance(data["sha256"], list) and all(isinstance(sha, str) for sha in data["sha256"]))
        or sorted(data["sha256"]) != sorted([record.challenger_sha256, record.incumbent_sha256])
        or record.queries[data["task_id"]] != data["query_index"]
    ):
        problems.append(f"its models' SHA-256 or its query index differ from what {record.name}'s round recorded")
    if problems:
        raise DataContractError(
            f"{label}: {'; '.join(problems[:4])}. Side-by-side tasks come from `rlhf label compare`; one edited by "
            "hand or by another tool is refused. Nothing was written."
        )
    return data, label, record


def read_verdicts(
    tasks: Iterable, where: str, root: str | Path, max_annotations: int = 100
) -> tuple[list[Round], VerdictReport]:
    """The rounds of ``root``'s ``side_by_side/`` that ``tasks`` (Label Studio's export) answer, with
    the new verdicts merged in (one per task and annotator; the same answer imported again adds nothing,
    a different one is refused as an edited export). Nothing is written: the caller saves the rounds."""
    rounds = _Rounds(Path(root))
    kept: dict[str, dict] = {}
    report, touched, choices_by_task = VerdictReport(), {}, {}
    key = project_key(root, create=False)
    for position, item in enumerate(tasks):
        data, label, record = _task_data(item, position, where, rounds)
        seen: set[str] = set()
        at = f"{label} (task_id {data['task_id']})"
        for annotation in task_annotations(item, label, max_annotations):
            report.annotations += 1
            answered = answered_choice(
                annotation, at, set(CHOICES.values()), "a, b or tie", "rlhf label config --side-by-side", seen, report,
                key,
            )  # fmt: skip
            if answered is None:
                continue
            who, chosen = answered
            winner = TIE if chosen == TIE else _whose(chosen, record.order[data["task_id"]])
            choices_by_task.setdefault(data["task_id"], []).append(winner)
            if record.name not in kept:
                kept[record.name] = {(v["task_id"], v["annotator"]): v["winner"] for v in record.verdicts}
            answer = (data["task_id"], who)
            previous = kept[record.name].get(answer)
            if previous is not None:
                if previous != winner:
                    raise DataContractError(
                        f"{at}, annotation by annotator {plain(who, 80)}: already recorded as {previous} in "
                        f"{record.name}'s round, and this export says {winner}. One of the two exports was changed "
                        "after the answers were given; nothing was written."
                    )
                report.already_there += 1
                continue
            kept[record.name][answer] = winner
            record.verdicts.append(
                {"task_id": data["task_id"], "query_index": data["query_index"], "annotator": who, "winner": winner}
            )
            report.added[record.name] += 1
            touched[record.name] = record
    report.agreement, report.tasks_with_several = pairwise_agreement(choices_by_task)
    return list(touched.values()), report


class _Rounds(dict):
    """The rounds of a project's ``side_by_side/`` by name, each loaded (and checked) when a task first
    names it: a damaged round refuses only the exports that answer it."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def get(self, name, default=None):
        if name not in self:
            path = Path(self.root, ROUNDS, f"{name}.json")
            if not (len(name) <= 512 and name.isprintable() and "/" not in name and path.is_file()):
                return default
            self[name] = load_round(path, self.root)
        return super().get(name, default)


def import_verdicts(handle, where: str, root: str | Path, limits: LabellingParams) -> tuple[list[Round], VerdictReport]:
    """Label Studio's export (an open text file, from a file or the server) read into the rounds it
    answers (:func:`read_verdicts`), each round saved; nothing is saved when any task is refused. The
    rounds' lock is held from the first read to the last write: two imports at once keep both's verdicts."""
    with rounds_lock(root):
        tasks = (task for _, task in read_export(handle, where, limits))
        rounds, report = read_verdicts(tasks, where, root, limits.max_annotations_per_task)
        for answered in rounds:
            answered.save(root)
    return rounds, report


def _whose(choice: str, a_is: str) -> str:
    """Which model the choice ``a`` or ``b`` names, given who wrote Response A."""
    other = INCUMBENT if a_is == CHALLENGER else CHALLENGER
    return a_is if choice == "a" else other


def tally(verdicts: Iterable[dict], tie_weight: float, confidence: float) -> Tally:
    """The round's verdicts counted for the gate (:class:`rlhf_pipeline.promotion.Tally`): those of a
    round :func:`load_round` accepted, so each is one person's one answer to a task of the round."""
    counts: Counter = Counter()
    people: Counter = Counter()
    for verdict in verdicts:
        counts[verdict["winner"]] += 1
        people[verdict["annotator"]] += 1
    return Tally(
        counts[CHALLENGER], counts[TIE], counts[INCUMBENT], tie_weight, confidence, dict(sorted(people.items()))
    )
