"""Probe: how well can a reward head on the frozen base model's features rank best-of-4 samples?

Samples best-of-N responses from ``models/base`` on the pipeline's queries (``data/queries``),
exactly as the ``preferences`` stage does (task sampling and truncation from ``params.yaml``),
labels them with the gold labeler (argmax, ties broken at random, as at label temperature 0),
and keeps, for every response, pooled hidden states of several layers, captured while sampling.
Then fits a linear head with the reward model's loss (softmax over the N samples against
``best``, L2-regularised) on the first n labels, for several n, and reports best-of-N accuracy on
held-out rows against the label ceiling.

This answers "which layer, which pooling, how many labels" before any reward model is trained.
Features are cached (``--cache``), so fitting variants is quick.

Usage: .venv/bin/python bench/probe_reward_features.py --labels 2048 --test-labels 288 [--cache bench/.cache/probe.pt]
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

POOLS = ("last", "mean", "sum")


def sample_features(args) -> dict:
    from rlhf_pipeline.labelers import get_labeler
    from rlhf_pipeline.models import load_causal_lm, load_tokenizer
    from rlhf_pipeline.params.schema import load_params
    from rlhf_pipeline.preferences.simulated import pick_best
    from rlhf_pipeline.sampling import ResponseSampler

    params = load_params("params.yaml")
    task = params.task.model_copy(
        update={
            "response_length": args.response_length,
            "truncate_token": None if args.truncate_after < 0 else ".",
            "truncate_after": max(args.truncate_after, 0),
        }
    )
    tokenizer = load_tokenizer("models/base")
    model = load_causal_lm("models/base").eval()
    norm = model.model.norm
    n_layers = model.config.num_hidden_layers
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(range(0, n_layers + 1, 3))
    sampler = ResponseSampler.from_tokenizer(task, tokenizer)
    from datasets import load_from_disk

    from rlhf_pipeline.queries import build_queries

    cut, _ = build_queries(
        load_from_disk(args.corpus)["text"], tokenizer, args.query_length, None, ".", 0.4, params.seed
    )
    labeler = get_labeler(params.data.preferences.labeler)
    generator = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = {}
    for split, count in (("train", args.labels), ("test", args.test_labels)):
        pool = torch.tensor(cut[split]["query_ids"])
        order = torch.cat([torch.randperm(len(pool), generator=generator) for _ in range(-(-count // len(pool)))])[
            :count
        ]
        feats = {(layer, p): [] for layer in layers for p in POOLS}
        tokens = {layer: [] for layer in args.token_layers}
        gold, valid_all, ids = [], [], []
        started = time.perf_counter()
        for start in range(0, count, args.batch):
            queries = pool[order[start : start + args.batch]]
            with torch.no_grad():
                sampled, truncated, valid = sampler.sample(
                    model, queries, generator, num_samples=args.samples, capture_layers=layers
                )
                q = queries.shape[1]
                keep = (truncated != tokenizer.pad_token_id).float()  # response tokens kept after truncation
                lengths = keep.sum(-1).clamp(min=1)
                last = (keep.cumsum(-1) == keep.sum(-1, keepdim=True)) & keep.bool()
                for layer in layers:
                    states = sampled.hidden[layer][:, q:]
                    if layer < n_layers:
                        states = norm(states)
                    feats[(layer, "sum")].append((states * keep[..., None]).sum(1))
                    feats[(layer, "mean")].append((states * keep[..., None]).sum(1) / lengths[:, None])
                    feats[(layer, "last")].append((states * last[..., None].float()).sum(1))
                    if layer in tokens:
                        tokens[layer].append(states.half())
            texts = tokenizer.batch_decode(truncated, skip_special_tokens=True)
            gold.append(np.asarray(labeler.score(texts), dtype=np.float64).reshape(-1, args.samples))
            valid_all.append(valid.view(-1, args.samples))
            ids.append(truncated.view(-1, args.samples, truncated.shape[-1]))
            done = min(start + args.batch, count)
            print(f"{split}: {done}/{count} rows, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        gold_arr = np.concatenate(gold)
        out[split] = {
            "features": {key: torch.cat(v).view(count, args.samples, -1) for key, v in feats.items()},
            "gold": torch.tensor(gold_arr),
            "best": torch.tensor(pick_best(gold_arr, 0.0, rng)),
            "valid": torch.cat(valid_all),
            "ids": torch.cat(ids),
            "tokens": {layer: torch.cat(v).view(count, args.samples, *v[0].shape[1:]) for layer, v in tokens.items()},
            "seconds": time.perf_counter() - started,
        }
    out["layers"] = layers
    return out


def fit_head(x_train: torch.Tensor, best: torch.Tensor, l2: float, steps: int = 200) -> torch.Tensor:
    """Linear head w (d,) minimising mean CE(softmax_i(x_i . w), best) + l2 |w|^2 (L-BFGS)."""
    w = torch.zeros(x_train.shape[-1], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x_train @ w, best) + l2 * (w * w).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return w.detach()


def accuracy(x: torch.Tensor, w: torch.Tensor, best: torch.Tensor) -> float:
    return float(((x @ w).argmax(-1) == best).double().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, default=2048)
    parser.add_argument("--test-labels", type=int, default=288)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", default="", help="comma-separated; default every 3rd")
    parser.add_argument("--token-layers", default="0,3,6", help="layers whose per-token states are kept too (fp16)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--query-length", type=int, default=24)
    parser.add_argument("--corpus", default="data/corpus", help="a datasets folder with a 'text' column")
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--truncate-after", type=int, default=-1, help="-1: no truncation")
    parser.add_argument("--cache", default="bench/.cache/probe_features.pt")
    parser.add_argument("--sizes", default="256,512,1024,2048")
    parser.add_argument("--l2", default="1e-4,1e-3,1e-2")
    args = parser.parse_args()
    args.token_layers = [int(x) for x in args.token_layers.split(",") if x]
    torch.set_num_threads(2)
    cache = Path(args.cache)
    if cache.is_file():
        data = torch.load(cache, weights_only=True)  # tensors and plain containers only
    else:
        data = sample_features(args)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, cache)
    train, test = data["train"], data["test"]
    ceiling = float((test["gold"].argmax(-1) == test["best"]).double().mean())
    tied = float(np.mean([(g == g.max()).sum() > 1 for g in test["gold"].numpy()]))
    print(
        f"sampling: train {train['seconds']:.0f} s for {len(train['best'])} rows, test {test['seconds']:.0f} s; "
        f"valid responses {float(train['valid'].float().mean()):.2f}; test ceiling {ceiling:.3f} ({tied:.2f} tied)"
    )
    sizes = [int(s) for s in args.sizes.split(",") if int(s) <= len(train["best"])]
    l2s = [float(x) for x in args.l2.split(",")]
    print("| layer | pooling | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---|---|" + "---:|" * len(sizes))
    for layer in data["layers"]:
        for pool in POOLS:
            x_all = train["features"][(layer, pool)].double()
            cells = []
            for n in sizes:
                x = x_all[:n]
                mean, std = x.reshape(-1, x.shape[-1]).mean(0), x.reshape(-1, x.shape[-1]).std(0) + 1e-6
                xt = (x - mean) / std
                xs = (test["features"][(layer, pool)].double() - mean) / std
                # choose l2 on the last 20% of the n rows, refit on all n
                cut = int(0.8 * n)
                best_l2 = max(
                    l2s,
                    key=lambda l2: accuracy(
                        xt[cut:], fit_head(xt[:cut], train["best"][:cut], l2), train["best"][cut:n]
                    ),
                )
                w = fit_head(xt, train["best"][:n], best_l2)
                cells.append(f"{accuracy(xs, w, test['best']):.3f}")
            print(f"| {layer} | {pool} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
