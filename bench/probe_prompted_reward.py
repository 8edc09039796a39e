"""Probe: does the base model already know the labeller's sentiment, so that few labels would do?

Scores the four samples of every held-out preference row (``data/preferences``, the pipeline's own
test labels) with the frozen base model (``models/base``) and no training at all, two ways:

- **contrastive prompt**: log p(response | a "positive sentence" instruction) minus
  log p(response | a "negative sentence" instruction), summed over the response tokens;
- **zero-shot question**: the response in a chat turn asking whether its sentiment is positive or
  negative, scored by log p(" positive") - log p(" negative") at the answer position.

It reports each score's best-of-N accuracy against the labels, beside chance and the label ceiling
(:func:`rlhf_pipeline.preferences.simulated.ceiling_accuracy`). A score near chance means the reward model can
only learn the labeller's sentiment from the labels themselves.

Usage: .venv/bin/python bench/probe_prompted_reward.py [--rows 288] [--output FILE]
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

POSITIVE = "Write a very happy, positive, cheerful sentence:"
NEGATIVE = "Write a very sad, negative, angry sentence:"
QUESTION = "Is the sentiment of this text positive or negative? Answer with one word.\n\nText: {text}"


def continuation_logprob(model, tokenizer, prefix: str, texts: list[str]) -> torch.Tensor:
    """sum_t log p(text_t | prefix, text_<t) for each text, one padded batch."""
    prefix_ids = tokenizer(prefix)["input_ids"]
    rows = [prefix_ids + tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, rows))
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    with torch.no_grad():
        logprobs = model(input_ids=ids, attention_mask=mask).logits[:, :-1].log_softmax(-1)
    token_logprobs = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    in_text = torch.zeros_like(token_logprobs)
    for i, row in enumerate(rows):
        in_text[i, len(prefix_ids) - 1 : len(row) - 1] = 1
    return (token_logprobs * in_text).sum(-1)


def answer_margin(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """log p(" positive") - log p(" negative") after the chat-templated question about each text."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION.format(text=text.strip())}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for text in texts
    ]
    positive, negative = (
        tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in ("positive", "negative")
    )
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        last = model(**batch).logits[:, -1].log_softmax(-1)
    return last[:, positive] - last[:, negative]


def main() -> None:
    from datasets import load_from_disk

    from rlhf_pipeline.models import load_causal_lm, load_tokenizer
    from rlhf_pipeline.preferences.simulated import ceiling_accuracy

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=288, help="held-out rows to score (the first n)")
    parser.add_argument("--output", help="also write the report here")
    args = parser.parse_args()
    common.setup(seed=0)
    tokenizer, model = load_tokenizer("models/base"), load_causal_lm("models/base").eval()
    test = load_from_disk("data/preferences")["test"]
    test = test.select(range(min(args.rows, len(test))))
    started = time.perf_counter()
    picks: dict[str, list[int]] = {"contrastive prompt": [], "zero-shot question": []}
    for row in test:
        contrast = continuation_logprob(model, tokenizer, POSITIVE, row["samples"])
        contrast = contrast - continuation_logprob(model, tokenizer, NEGATIVE, row["samples"])
        picks["contrastive prompt"].append(int(contrast.argmax()))
        picks["zero-shot question"].append(int(answer_margin(model, tokenizer, row["samples"]).argmax()))
    best, gold = np.array(test["best"]), np.array(test["gold"])
    chance = float(np.mean([1 / len(samples) for samples in test["samples"]]))
    lines = [
        "# Prompted reward probe: the frozen base model's own sentiment, no labels",
        "",
        f"Command: `.venv/bin/python bench/probe_prompted_reward.py --rows {args.rows}`; {len(test)} held-out rows "
        f"of `data/preferences`, {time.perf_counter() - started:.0f} s on this machine.",
        "",
        "| score | best-of-N accuracy against the labels |",
        "|---|---:|",
        *(f"| {name} | {float((np.array(p) == best).mean()):.3f} |" for name, p in picks.items()),
        f"| chance | {chance:.3f} |",
        f"| label ceiling | {ceiling_accuracy(gold, best):.3f} |",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        Path(args.output).write_text(report)


if __name__ == "__main__":
    main()
