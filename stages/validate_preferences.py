"""Stage validate_preferences: the Great Expectations contract on data/preferences -> data/validation.

Always writes ``data/validation/result.json`` (GX results per split) and ``summary.json``
(``{"success", "rows", "splits", "failures"}``), and Great Expectations Data Docs of the run in
``data/validation_docs/`` (``index.html``, readable offline); exits 3 when the contract fails, so
nothing downstream trains on bad labels. ``min_rows`` applies to the train split.
"""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

from pathlib import Path

from datasets import load_from_disk

from rlhf_pipeline import paths
from rlhf_pipeline.contract import format_summary, optional_tokenizer, summary_payload, validate_dataframe
from rlhf_pipeline.datadocs import write_data_docs
from rlhf_pipeline.errors import DataContractError, PipelineError
from rlhf_pipeline.io import atomic_dir, read_json, write_json
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.preferences.formats import PAIRED_FORMATS, display_names, internal_to_flat
from rlhf_pipeline.runner import run_stage

BASE, PREFS, OUT, DOCS = paths.BASE_MODEL, paths.PREFERENCES, paths.VALIDATION, paths.VALIDATION_DOCS


class Params(StageParams):
    data: DataParams = DataParams()


def main(params: Params) -> None:
    cfg = params.data.validation
    try:
        prefs = load_from_disk(PREFS)
    except FileNotFoundError:
        raise PipelineError(f"{PREFS} is missing; run `dvc repro preferences` first.") from None
    info = Path(PREFS, "format.json")
    written = read_json(info) if info.is_file() else {}
    fmt = written.get("format", "best_of_n")
    tokenizer = optional_tokenizer(BASE)
    results = {}
    for name in ("train", "test"):
        if name not in prefs:
            raise PipelineError(f"{PREFS} has no {name!r} split (it has {list(prefs)}); rerun `dvc repro preferences`.")
        results[name] = validate_dataframe(
            internal_to_flat(prefs[name]),
            cfg,
            tokenizer,
            label_check=fmt not in PAIRED_FORMATS,
            min_rows=cfg.min_rows if name == "train" else 1,
            names=display_names(fmt),
        )
    summary = summary_payload(results)
    if written.get("truncated"):  # a user's texts cut to the task's lengths by the preferences stage
        summary["truncated"] = written["truncated"]
    with atomic_dir(OUT) as tmp:
        write_json(tmp / "result.json", {name: r.gx_json for name, r in results.items()})
        write_json(tmp / "summary.json", summary)
    write_data_docs({name: r.gx_json for name, r in results.items()}, DOCS, f"{PREFS}: preference-data contract")
    text = "\n".join(format_summary(r, title=f"{PREFS} {name}") for name, r in results.items())
    for name, cuts in summary.get("truncated", {}).items():
        text += f"\n{PREFS} {name}: cut to fit: " + ", ".join(
            f"{n} {what.replace('_', ' ')}" for what, n in cuts.items()
        )
    if not summary["success"]:
        raise DataContractError(f"the preference data failed its contract (details in {OUT}/summary.json):\n{text}")
    print(text)


if __name__ == "__main__":
    run_stage("validate_preferences", main, Params)
