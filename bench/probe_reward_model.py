"""Probe: reward-model variants trained on the pipeline's own preference data (``data/preferences``).

Trains a :class:`rlhf_pipeline.reward.model.RewardModel` with the library's ``train_reward_model`` (the
stage's training loop) on the first ``--labels`` train rows and reports best-of-N accuracy on the
test rows, for one variant per call: how many of the base model's blocks the reward model keeps
(``--layers``), how many of those are frozen (``--freeze``, embeddings always frozen here),
pooling, lr, epochs, batch. The label ceiling of the test rows is printed for reference.

Usage: .venv/bin/python bench/probe_reward_model.py --layers 6 --freeze 0 --pooling mean --lr 1e-4 --epochs 2
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


def main() -> None:
    from datasets import load_from_disk

    from rlhf_pipeline.models import freeze_lower_layers, load_tokenizer
    from rlhf_pipeline.params.reward import RewardTrainParams
    from rlhf_pipeline.reward.adoption import reward_model_on_base
    from rlhf_pipeline.reward.training import best_of_n_accuracy, preference_tensors, train_reward_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--freeze", type=int, default=0)
    parser.add_argument("--pooling", default="mean")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--labels", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--preferences", default="data/preferences")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer("models/base")
    prefs = load_from_disk(args.preferences)
    train = preference_tensors(prefs["train"])
    test = preference_tensors(prefs["test"])
    n = args.labels or len(train[2])
    train = tuple(t[:n] for t in train)
    gold = np.asarray(prefs["test"]["gold"])
    ceiling = float((gold.argmax(1) == np.asarray(prefs["test"]["best"])).mean())
    model = reward_model_on_base(
        "models/base",
        tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(args.seed),
        pooling=args.pooling,
        num_layers=args.layers,
    )
    model.backbone.get_input_embeddings().weight.requires_grad_(False)
    freeze_lower_layers(model.backbone, args.freeze)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    started = time.perf_counter()
    cfg = RewardTrainParams(lr=args.lr, epochs=args.epochs, batch_size=args.batch, microbatch_size=args.batch)
    history = train_reward_model(model, train, cfg, torch.Generator().manual_seed(args.seed))
    seconds = time.perf_counter() - started
    accuracy = best_of_n_accuracy(model, *test[:3], batch_size=64)
    tail = history[-max(1, len(history) // 4) :]
    print(
        f"layers {args.layers} freeze {args.freeze} pooling {args.pooling} lr {args.lr} epochs {args.epochs} batch "
        f"{args.batch} labels {n}: "
        f"test accuracy {accuracy:.3f} (ceiling {ceiling:.3f}, {len(test[2])} rows); train accuracy "
        f"{np.mean([r['accuracy'] for r in tail]):.2f}; "
        f"{trainable / 1e6:.1f}M trainable; {seconds:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
