"""The module PPO trains: the policy LM and a value estimate per response token, and how it is saved."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from rlhf_pipeline.errors import NonFiniteError
from rlhf_pipeline.functional import non_finite_tensors
from rlhf_pipeline.models import save_tokenizer
from rlhf_pipeline.sampling import hidden_from, response_outputs

VALUE_HEAD_FILE = "value_head.safetensors"


class PolicyWithValue(nn.Module):
    """Policy LM with a value estimate for each response position.

    ``value_model='shared'`` (reference): a zero-initialised scalar head on the policy's final
    hidden state (OAI ``fc_layer`` with scale 0). ``'separate'``: a reward-model copy (backbone
    and head) predicts values, as TRL does.
    """

    def __init__(self, lm: nn.Module, value_backbone: nn.Module | None = None, value_head: nn.Linear | None = None):
        super().__init__()
        self.lm = lm
        self.value_backbone = value_backbone
        if value_head is None:
            value_head = nn.Linear(lm.config.hidden_size, 1)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head

    @property
    def shared(self) -> bool:
        return self.value_backbone is None

    def forward(
        self,
        query_responses: Tensor,
        mask: Tensor,
        query_length: int,
        temperature: float,
        pad_token_id: int,
        freeze_layers: int = 0,
        trunk: Tensor | None = None,
    ):
        """(logprobs, entropy, values) of the response tokens: each (B, R)."""
        args = (query_responses, mask, query_length, temperature, pad_token_id, freeze_layers, trunk)
        out = response_outputs(self.lm, *args, entropy=True)
        logprobs, entropy = out.logprobs, out.entropy
        if self.shared:
            values = self.value_head(out.hidden).squeeze(-1).float()
        else:
            value_hidden = hidden_from(self.value_backbone_as_lm(), query_responses, mask)[:, query_length - 1 : -1]
            values = self.value_head(value_hidden).squeeze(-1).float()
        return logprobs, entropy, values

    def value_backbone_as_lm(self):
        return _BackboneAsModel(self.value_backbone)

    @torch.no_grad()
    def values_of(self, query_responses: Tensor, mask: Tensor, query_length: int) -> Tensor:
        value_hidden = hidden_from(self.value_backbone_as_lm(), query_responses, mask)[:, query_length - 1 : -1]
        return self.value_head(value_hidden).squeeze(-1).float()


class _BackboneAsModel:
    """Lets :func:`hidden_from` treat a bare backbone (AutoModel) like a *ForCausalLM."""

    def __init__(self, backbone: nn.Module):
        self.base_model = backbone
        self.config = backbone.config


def trainable_state(module: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().cpu().contiguous() for name, p in module.named_parameters() if p.requires_grad}


def save_policy(
    policy: PolicyWithValue, tokenizer, directory: str | Path, temperature: float, response_length: int
) -> None:
    """save_pretrained layout (loads with AutoModelForCausalLM) plus the value head.

    ``generation_config.json`` holds the sampling PPO trained with (pure sampling at ``temperature``,
    no top-k/top-p, ``response_length`` new tokens), so a plain ``generate`` samples as in training
    instead of decoding greedily; the tokenizer is saved padding on the left, as batched
    generation needs."""
    directory = Path(directory)
    bad = non_finite_tensors(trainable_state(policy))
    if bad:
        raise NonFiniteError(
            f"The trained policy's weights are not finite ({', '.join(bad[:3])}...); {directory} was not written."
        )
    policy.lm.save_pretrained(directory)
    sampling = copy.deepcopy(policy.lm.generation_config)
    sampling.update(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=response_length,
        pad_token_id=tokenizer.pad_token_id,
    )
    sampling.save_pretrained(directory)
    save_tokenizer(tokenizer, directory, padding_side="left")
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()},
        str(directory / VALUE_HEAD_FILE),
    )
