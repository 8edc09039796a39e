"""Lab script (2026-12-03): evaluate's exact KL on one batch of the default run (96 held-out queries x 2
responses, the policy sharing its lowest 24 blocks with the base), the policy's final states from a forward
of its top blocks (as before eba244c) against those its sampling forwards kept (eba244c), alternated.

    .venv/bin/python bench/results/zen3_2026-12-03/exact_kl_states.py   # in a checkout after `dvc repro`
"""

import rlhf_pipeline.offline  # noqa: F401

import time

import torch
import yaml

from rlhf_pipeline import allocator
from rlhf_pipeline.decoding import SampleOutput
from rlhf_pipeline.evaluation import exact_kl_and_reference_logprobs, repeat_rows
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.queries import load_queries
from rlhf_pipeline.sampling import ResponseSampler, final_state_layer, shared_lower_blocks

allocator.keep_freed_memory()  # as every stage
torch.set_num_threads(2)
task = TaskParams(**yaml.safe_load(open("params.yaml"))["task"])
tokenizer = load_tokenizer("models/base")
base = load_causal_lm("models/base", "cpu").eval()
policy = load_causal_lm("models/policy", "cpu").eval()
queries = load_queries("data/queries", "test", tokenizer.pad_token_id, 512)[:96]
sampler = ResponseSampler.from_tokenizer(task, tokenizer)
shared, final = shared_lower_blocks(policy, base), final_state_layer(policy)
print(f"queries {tuple(queries.shape)}, 2 responses each; blocks shared with the base: {shared} of {final}")
with torch.no_grad():
    kept = sampler.sample(
        policy, queries, torch.Generator().manual_seed(3), num_samples=2, capture_layers=(shared, final)
    )[0]
    forward = SampleOutput(kept.responses, kept.logprobs, None, kept.mask, {shared: kept.hidden[shared]})
    rows, results = repeat_rows(queries, 2), {}
    for round_ in range(3):
        for name, samples in (("forward", forward), ("kept", kept)):
            start = time.perf_counter()
            results[name] = exact_kl_and_reference_logprobs(
                policy, base, rows, samples, task.temperature, tokenizer.pad_token_id, shared
            )
            print(f"round {round_}: {name:8s} {time.perf_counter() - start:.2f} s", flush=True)
(kl_kept, lp_kept), (kl_forward, lp_forward) = results["kept"], results["forward"]
print(
    f"exact KL: largest difference a response {(kl_kept - kl_forward).abs().max().item():.2e}, "
    f"means {kl_kept.mean().item():.6f} (kept) and {kl_forward.mean().item():.6f} (forward)"
)
print(f"the base's logprobs of the sampled tokens the same bytes: {torch.equal(lp_kept, lp_forward)}")
