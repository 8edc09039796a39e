"""``data``: the corpus, the queries cut from it, the preference labels and their contract."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_pipeline.params import MAX_BATCH, MAX_ROWS, MAX_SMALL, MAX_TOKENS, Strict

GENERATED = "generated"  # data.corpus.source: passages sampled from the base model
SIMULATED = "simulated"  # data.preferences.source: labels from a simulated labeler (the gold score)


class CorpusParams(Strict):
    source: str = Field(
        GENERATED,
        description="'generated' (passages sampled from the base model on built-in topics), a local "
        ".txt/.jsonl/.parquet file, or a hub dataset id.",
    )
    text_column: str = "text"
    split: str = "train"
    num_passages: int = Field(2048, gt=0, le=MAX_ROWS)
    passage_tokens: int = Field(96, gt=0, le=MAX_TOKENS, description="New tokens sampled per generated passage.")
    temperature: float = Field(1.0, gt=0.0)
    batch_size: int = Field(64, gt=0, le=MAX_BATCH, description="Passages per generation batch.")
    samples_per_prompt: int = Field(
        1, gt=0, le=MAX_SMALL, description="Generated passages per topic prompt, sharing one prefill of the prompt."
    )


class QueriesParams(Strict):
    query_length: int = Field(
        64, gt=0, le=MAX_TOKENS, description="Query tokens; a longer chat prompt keeps its last ones."
    )
    prompts: str | None = Field(
        None,
        description="task.chat only: a .jsonl/.parquet file (or hub dataset) whose 'prompt' column holds the PPO "
        "prompts, as lists of role/content messages or as user texts; null: the prompts of the conversational "
        "preference data (data.preferences.source).",
    )
    start_text: str | None = Field(".", description="Keep tokens after its first occurrence; null disables.")
    end_text: str | None = Field(".", description="Cut after its last occurrence; null disables.")
    test_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    min_test_queries: int = Field(
        64,
        gt=0,
        le=MAX_ROWS,
        description="Fewest held-out queries the queries stage accepts (not a reference detail: the evaluation's "
        "standard error over fewer is too wide to tell a policy from the base); a corpus whose passages the rules "
        "drop stops there, not with a noisy number at the end.",
    )


class PreferencesParams(Strict):
    source: str = Field(
        SIMULATED,
        description="'simulated' (labeler on base-model samples) or a local .jsonl/.parquet file / hub "
        "dataset in pairwise (prompt, chosen, rejected) or best-of-N (query, sample0.., best) format.",
    )
    split: str = "train"
    num_samples: int = Field(4, ge=2, le=MAX_SMALL, description="Responses per query (best-of-N).")
    num_labels: int = Field(
        4992, gt=0, le=MAX_ROWS, description="Train queries to label (reference: 4992 sentiment labels)."
    )
    num_test_labels: int = Field(
        256, gt=0, le=MAX_ROWS, description="Held-out test queries labelled for RM test accuracy."
    )
    labeler: Literal["vader"] = "vader"
    label_temperature: float = Field(0.0, ge=0.0, description="0: argmax; >0: sample best ~ softmax(score/T).")
    batch_size: int = Field(32, gt=0, le=MAX_BATCH, description="Queries per generation batch.")


class ValidationParams(Strict):
    min_rows: int = Field(64, gt=0, le=MAX_ROWS)
    max_text_chars: int = Field(4000, gt=0, le=MAX_ROWS)
    max_tokens: int = Field(512, gt=0, le=MAX_TOKENS, description="Upper bound on tokens of a query or sample.")
    max_label_share: float = Field(
        0.95, gt=0.0, le=1.0, description="Most common 'best' index share above this is degenerate."
    )
    max_abs_margin: float = Field(
        100.0,
        gt=0.0,
        description="Bound on |margin| (reward units; Llama 2's margins are 0-3): "
        "larger or non-finite margins make the reward loss overflow at the first step.",
    )
    min_agreement: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Human labels (`rlhf label import`): refuse an export whose annotators agree on fewer than "
        "this share of the pairs of annotations of one task (null: report the agreement only). Not a reference "
        "detail: OpenAI measured 38-60% agreement between labellers on best-of-4.",
    )


class DataParams(Strict):
    corpus: CorpusParams = CorpusParams()
    queries: QueriesParams = QueriesParams()
    preferences: PreferencesParams = PreferencesParams()
    validation: ValidationParams = ValidationParams()
