"""The model families users bring, beyond the tiny Llama: the trunk split finds their blocks, and
the packed best-of-N reward scorer equals scoring each query + response on its own on every one,
sliding-window attention included."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, SLIDING, VOCAB, WINDOW, tiny_backbone, tiny_causal_lm
from torch import nn

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.models import backbone_of, freeze_lower_layers, transformer_layers
from rlhf_pipeline.reward.model import RewardModel, attention_window

PAD = VOCAB - 1


def rows(batch: int, n: int, query: int, response: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    queries = torch.randint(1, PAD, (batch, query), generator=g)
    queries[0, :2] = PAD  # left padding
    samples = torch.randint(1, PAD, (batch, n, response), generator=g)
    samples[0, -1, response // 2 :] = PAD  # a truncated response
    samples[1, 0, :] = PAD  # an empty one
    return queries, samples


def one_by_one(model: RewardModel, queries: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    batch, n, length = samples.shape
    joined = torch.cat([queries.repeat_interleave(n, 0), samples.reshape(batch * n, length)], 1)
    return model.raw_scores(joined, query_length=queries.shape[1]).view(batch, n)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_packed_scores_equal_one_by_one_on_every_family(model_type, pooling):
    """Rows of 10 + 3 x 7 tokens: longer than the sliding window (8) of Mistral, Gemma2 and Gemma3,
    packed or not; and rows of 3 + 3 x 2 tokens (each query + response within the window, the
    packed row not)."""
    model = RewardModel(tiny_backbone(model_type), PAD, pooling).eval()
    for shape in ((3, 3, 10, 7), (3, 3, 3, 2)):
        queries, samples = rows(*shape)
        with torch.no_grad():
            packed = model.score_best_of_n(queries, samples, normalized=False)
            torch.testing.assert_close(packed, one_by_one(model, queries, samples), atol=2e-5, rtol=2e-5)


def test_the_window_is_read_from_the_config():
    assert {t: attention_window(tiny_backbone(t).config) for t in SLIDING} == dict.fromkeys(SLIDING, WINDOW)
    assert attention_window(tiny_backbone("llama").config) is None
    qwen = tiny_backbone("qwen2").config
    qwen.sliding_window = 4  # Qwen2 has the field, but uses it only with use_sliding_window
    assert attention_window(qwen) is None


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_trunk_split_finds_the_blocks_of_every_family(model_type):
    lm = tiny_causal_lm(model_type)
    backbone = backbone_of(lm)
    layers = transformer_layers(backbone)
    assert len(layers) == 2
    trainable = freeze_lower_layers(backbone, 1)
    assert not any(p.requires_grad for p in layers[0].parameters())
    assert all(p.requires_grad for p in layers[1].parameters())
    assert 0 < trainable < sum(p.numel() for p in backbone.parameters())


def test_a_model_without_blocks_is_refused_naming_the_parameter():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tiny_backbone("llama").config
            self.proj = nn.Linear(4, 4)

    with pytest.raises(PipelineError, match=r"reward\.train\.num_layers needs the transformer blocks of Flat"):
        transformer_layers(Flat(), "reward.train.num_layers")
    with pytest.raises(PipelineError, match=r"ppo\.freeze_layers needs .* Set ppo\.freeze_layers"):
        freeze_lower_layers(Flat(), 1)
