"""Probe: which generated corpus gives best-of-4 labels a reward model can learn from?

For each set of topic-prompt styles (``--styles``), generates passages from ``models/base`` as the
``corpus`` stage does, cuts OAI queries from them, samples 4 responses per query as the
``preferences`` stage does, and reports what decides how informative the labels are: the share
of responses the gold labeler scores exactly 0 (neutral), of rows whose 4 gold scores tie at the
top (a coin-flip label), the spread of gold within a row, and how many responses the task's
truncation rule keeps (a '.' at or after ``truncate_after``) for several ``truncate_after``.

Usage: .venv/bin/python bench/probe_corpus.py [--passages 192] [--query-length 24] [--passage-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402,F401  (offline environment first)
import numpy as np  # noqa: E402
import torch  # noqa: E402

NARRATIVE_STYLES = [  # the built-in styles before the opinion/reaction ones
    "Write a short paragraph about {subject}.",
    "Describe {subject} in a few sentences.",
    "Tell a short story about {subject}.",
    "Write a cheerful paragraph about {subject}.",
    "Write a gloomy paragraph about {subject}.",
    "Write a few sentences about a memory of {subject}.",
    "Explain to a child what {subject} is like.",
    "Write a short diary entry about {subject}.",
]
OPINION_STYLES = [
    "In a few short sentences, say what you love about {subject}.",
    "In a few short sentences, say what you dislike about {subject}.",
    "Write a short, honest review of {subject}.",
    "Write a short, angry complaint about {subject}.",
    "Write a short, happy note about {subject}.",
    "Describe how {subject} makes you feel, in short sentences.",
    "Write a short diary entry about a good day with {subject}.",
    "Write a short diary entry about a bad day with {subject}.",
]


def main() -> None:
    from rlhf_pipeline import corpus
    from rlhf_pipeline.labelers import get_labeler
    from rlhf_pipeline.models import load_causal_lm, load_tokenizer
    from rlhf_pipeline.params.task import TaskParams
    from rlhf_pipeline.queries import build_queries
    from rlhf_pipeline.sampling import ResponseSampler

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=192)
    parser.add_argument("--passage-tokens", type=int, default=32)
    parser.add_argument("--query-length", type=int, default=24)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--corpus-temperature", type=float, default=1.0)
    parser.add_argument("--styles", default="narrative,reviews")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer("models/base")
    model = load_causal_lm("models/base").eval()
    labeler = get_labeler("vader")
    style_sets = {
        "narrative": NARRATIVE_STYLES,
        "opinion": OPINION_STYLES,
        "reviews": list(corpus.STYLES),
    }  # reviews: the shipped set
    print(
        "| styles | passages (s) | queries kept | neutral responses | tied rows | gold std in row | mean gold | "
        + " | ".join(f"valid@{t}" for t in (4, 6, 8))
        + " | mean response tokens to '.' |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * 4)
    for name in args.styles.split(","):
        corpus.STYLES = style_sets[name]
        started = time.perf_counter()
        texts = corpus.generate_passages(
            model, tokenizer, args.passages, args.passage_tokens, args.corpus_temperature, 64, args.seed
        )
        seconds = time.perf_counter() - started
        splits, counts = build_queries(texts, tokenizer, args.query_length, None, ".", 0.5, args.seed)
        queries = torch.tensor(splits["train"]["query_ids"] + splits["test"]["query_ids"])[:96]
        task = TaskParams(response_length=args.response_length, truncate_after=4)
        sampler = ResponseSampler.from_tokenizer(task, tokenizer)
        with torch.no_grad():
            out, _, _ = sampler.sample(model, queries, torch.Generator().manual_seed(args.seed), num_samples=4)
        valid = {}
        for t in (4, 6, 8):
            sampler.task = TaskParams(response_length=args.response_length, truncate_after=t)
            valid[t] = sampler.truncate(out.responses)[1].float().mean().item()
        sampler.task = TaskParams(response_length=args.response_length, truncate_after=6)
        truncated, _ = sampler.truncate(out.responses)
        gold = np.asarray(labeler.score(tokenizer.batch_decode(truncated, skip_special_tokens=True))).reshape(-1, 4)
        period = sampler.truncate_token_id
        first = [
            (row == period).nonzero()[0].item() + 1 if (row == period).any() else args.response_length
            for row in out.responses
        ]
        tied = np.mean([(g == g.max()).sum() > 1 for g in gold])
        print(
            f"| {name} | {seconds:.0f} | {counts['kept']}/{counts['passages']} | {np.mean(gold == 0):.2f} | "
            f"{tied:.2f} | "
            f"{gold.std(1).mean():.3f} | {gold.mean():.3f} | "
            + " | ".join(f"{valid[t]:.2f}" for t in (4, 6, 8))
            + f" | {np.mean(first):.1f} |",
            flush=True,
        )
        for text in texts[:3]:
            print("    passage:", repr(text[:150]))


if __name__ == "__main__":
    main()
