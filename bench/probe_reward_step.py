"""Where a reward-model training step's time goes on this machine (issue 37's speed item).

On ``models/base`` (the default run's SmolLM2, fp32) and the workload of bench/reward_throughput.py
(8 pairs, prompt 64 + 2 x 24 tokens, packed best-of-2 rows): the step as a bare loop (forward, loss,
backward, fused Adam) with torch's profiler, the matmul rate that implies, and the two costs
``train_reward_model`` adds around it: the non-finite gradient check and Adam's first step.

It runs as a stage does: the ``portable`` numerics pin at 2 threads and the stages' malloc setting
(:func:`rlhf_pipeline.allocator.keep_freed_memory`), both printed first.

Usage: ``.venv/bin/python bench/probe_reward_step.py`` from the project root, after ``dvc repro base_model``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rlhf_pipeline.offline  # noqa: F401,E402,I001

import torch  # noqa: E402
from common import environment_lines, random_token_ids, run_as_a_stage  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlhf_pipeline.functional import non_finite_tensors  # noqa: E402
from rlhf_pipeline.optim import adam  # noqa: E402
from rlhf_pipeline.reward.adoption import reward_model_on_base  # noqa: E402

BASE = "models/base"
PAIRS, PROMPT, RESPONSE = 8, 64, 24


def main() -> None:
    run_as_a_stage()
    print("\n".join(environment_lines(BASE)))
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    generator = torch.Generator().manual_seed(0)
    prompts = random_token_ids(tokenizer, (PAIRS, PROMPT), generator)
    samples = torch.stack([random_token_ids(tokenizer, (PAIRS, RESPONSE), generator) for _ in range(2)], 1)
    model = reward_model_on_base(BASE, tokenizer.pad_token_id).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = adam(trainable, lr=1e-5, eps=1e-5)

    def step() -> None:
        rewards = model.score_best_of_n(prompts, samples)
        torch.nn.functional.cross_entropy(rewards, torch.zeros(PAIRS, dtype=torch.long)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    started = time.perf_counter()
    step()
    print(f"first step (Adam's state allocated): {time.perf_counter() - started:.2f} s")
    step()
    started = time.perf_counter()
    for _ in range(3):
        step()
    print(f"bare step, mean of 3: {(time.perf_counter() - started) / 3:.2f} s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    matmul_s = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::mm") / 1e6
    embedding = model.backbone.get_input_embeddings().weight.numel()
    flops = 6 * (sum(p.numel() for p in trainable) - embedding) * PAIRS * (PROMPT + 2 * RESPONSE)
    print(f"matmul: {matmul_s:.2f} s for ~{flops / 1e9:.0f} GFLOP (6 x non-embedding parameters x tokens): "
          f"{flops / matmul_s / 1e9:.0f} GFLOP/s")  # fmt: skip
    print(f"tokens per step: ours {PAIRS * (PROMPT + 2 * RESPONSE)}, TRL's {2 * PAIRS * (PROMPT + RESPONSE)}")

    grads = {name: torch.randn_like(p) * 1e-3 for name, p in model.named_parameters() if p.requires_grad}
    started = time.perf_counter()
    for _ in range(3):
        non_finite_tensors(grads)
    print(f"non-finite gradient check, mean of 3: {(time.perf_counter() - started) / 3:.3f} s")


if __name__ == "__main__":
    main()
