"""The module PPO trains: the policy LM (fully, or through a LoRA adapter) and, for GAE, a value
estimate per response token; its checkpoint snapshot and how it is saved."""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from rlhf_pipeline.errors import NonFiniteError, ParamsError
from rlhf_pipeline.fit import linear_layer_names, ppo_fit_problems
from rlhf_pipeline.functional import non_finite_tensors
from rlhf_pipeline.models import backbone_of, load_causal_lm, model_skeleton, save_tokenizer, transformer_layers
from rlhf_pipeline.params.ppo import LoraParams, PPOParams
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.reward.persistence import load_reward_model
from rlhf_pipeline.sampling import hidden_from, response_outputs

VALUE_HEAD_FILE = "value_head.safetensors"
ADAPTER = "default"  # peft's name for the one adapter


class PolicyWithValue(nn.Module):
    """Policy LM with (``critic``) a value estimate for each response position.

    ``value_model='shared'`` (reference): a zero-initialised scalar head on the policy's final
    hidden state (OAI ``fc_layer`` with scale 0). ``'separate'``: a reward-model copy (backbone
    and head) predicts values, as TRL does. ``critic=False`` (the critic-free estimators): no value
    head at all. :meth:`add_lora` puts a LoRA adapter on ``lm`` (which stays the transformers model).
    ``recompute_logits``: the training forward keeps no logits for the backward (``ppo.recompute_logits``).
    """

    def __init__(
        self,
        lm: nn.Module,
        value_backbone: nn.Module | None = None,
        value_head: nn.Linear | None = None,
        critic: bool = True,
        recompute_logits: bool = False,
    ):
        super().__init__()
        self.lm = lm
        self.recompute_logits = recompute_logits
        self.value_backbone = value_backbone if critic else None
        if critic and value_head is None:
            value_head = nn.Linear(lm.config.hidden_size, 1)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head if critic else None
        # the peft wrapper of lm, kept out of the module tree (its parameters are lm's)
        object.__setattr__(self, "adapter", None)

    @property
    def critic(self) -> bool:
        return self.value_head is not None

    @property
    def shared(self) -> bool:
        """The value head reads the policy's own hidden state (no separate value model)."""
        return self.value_backbone is None

    # ---- LoRA --------------------------------------------------------------------------------
    def add_lora(self, lora: LoraParams, from_layer: int) -> None:
        """A LoRA adapter (peft) on the blocks from ``from_layer`` up: ``lm``'s own weights freeze,
        the blocks below keep none, so they stay the reference model's (the trunk split holds)."""
        from peft import LoraConfig, get_peft_model

        layers = transformer_layers(backbone_of(self.lm), "ppo.lora")
        targets = lora.target_modules
        if targets == "all-linear":  # peft refuses its own "all-linear" with layers_to_transform
            targets = linear_layer_names(layers[from_layer])
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=targets,
            layers_to_transform=list(range(from_layer, len(layers))),
        )
        with warnings.catch_warnings():  # peft 0.21 reads an attribute transformers 5 deprecates: not ours to fix
            warnings.simplefilter("ignore", FutureWarning)
            object.__setattr__(self, "adapter", get_peft_model(self.lm, config))  # lm is wrapped in place

    def adapter_disabled(self):
        """Inside the block ``lm`` is the base model (the reference policy): the adapter is off."""
        return self.adapter.disable_adapter() if self.adapter is not None else nullcontext()

    def lm_snapshot(self, trainable: dict[str, Tensor]) -> dict[str, Tensor]:
        """The LM weights that training changed, named as in the base model, from ``trainable``
        (this module's trainable state): those tensors themselves, or with LoRA each adapted layer's
        merged weight ``W + (alpha/r) B A``, exactly what :meth:`merged_lm` holds."""
        if self.adapter is None:
            return {name: tensor for name, tensor in trainable.items() if name.startswith("lm.")}
        with torch.no_grad():
            return {
                f"lm.{name}.weight": (module.base_layer.weight + module.get_delta_weight(ADAPTER)).detach().cpu()
                for name, module in self.lm.named_modules()
                if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")
            }

    def merged_lm(self) -> nn.Module:
        """``lm`` as a plain transformers model: with LoRA, the adapter merged into its weights (once)."""
        if self.adapter is not None:
            self.lm = self.adapter.merge_and_unload()
            object.__setattr__(self, "adapter", None)
        return self.lm

    # ---- forwards ----------------------------------------------------------------------------
    def forward(
        self,
        query_responses: Tensor,
        mask: Tensor,
        query_length: int,
        temperature: float,
        pad_token_id: int,
        freeze_layers: int = 0,
        trunk: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(logprobs, entropy, values) of the response tokens: each (B, R); values None without a critic."""
        args = (query_responses, mask, query_length, temperature, pad_token_id, freeze_layers, trunk)
        out = response_outputs(self.lm, *args, entropy=True, recompute_logits=self.recompute_logits)
        if not self.critic:
            return out.logprobs, out.entropy, None
        if self.shared:
            values = self.value_head(out.hidden).squeeze(-1).float()
        else:
            value_hidden = hidden_from(self.value_backbone_as_lm(), query_responses, mask)[:, query_length - 1 : -1]
            values = self.value_head(value_hidden).squeeze(-1).float()
        return out.logprobs, out.entropy, values

    def value_backbone_as_lm(self):
        return _BackboneAsModel(self.value_backbone)

    @torch.no_grad()
    def values_of(self, query_responses: Tensor, mask: Tensor, query_length: int) -> Tensor:
        value_hidden = hidden_from(self.value_backbone_as_lm(), query_responses, mask)[:, query_length - 1 : -1]
        return self.value_head(value_hidden).squeeze(-1).float()


def build_policy(
    base_dir: str | Path,
    cfg: PPOParams,
    device: torch.device | str = "cpu",
    value_from: str | Path | RewardModel | None = None,
) -> PolicyWithValue:
    """The policy ``ppo`` asks for, from the base model in ``base_dir``: with a LoRA adapter
    (``cfg.lora``) or fully trainable, and its value estimate: a head on the policy (``shared``),
    a value model initialised from the reward model ``value_from`` or the one saved in that folder
    (``separate``, TRL style), or none (a critic-free ``cfg.advantage``)."""
    lm = load_causal_lm(base_dir, device, cfg.dropout)
    if cfg.critic_free or cfg.value_model == "shared":
        policy = PolicyWithValue(lm, critic=not cfg.critic_free, recompute_logits=cfg.recompute_logits)
    else:
        is_model = isinstance(value_from, nn.Module)
        value_init = value_from.to(device) if is_model else load_reward_model(value_from, device)
        policy = PolicyWithValue(
            lm, value_init.backbone.train(), value_init.head, recompute_logits=cfg.recompute_logits
        )
    if cfg.lora is not None:
        policy.add_lora(cfg.lora, cfg.freeze_layers)
    return policy


def require_fit(cfg: PPOParams, base_dir: str | Path, world_size: int = 1) -> None:
    """Refuse (params.yaml's exit code) a ``ppo`` section that cannot train the model at ``base_dir``
    on ``world_size`` processes, from its config alone: before any weight loads."""
    problems = ppo_fit_problems(cfg, model_skeleton(base_dir), str(base_dir))
    split = cfg.process_split_problem(world_size)
    if split:
        problems.append(split)
    if problems:
        raise ParamsError("params.yaml", problems)


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
    """save_pretrained layout (loads with AutoModelForCausalLM: a LoRA adapter is merged first) plus
    the value head when there is one.

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
    lm = policy.merged_lm()
    lm.save_pretrained(directory)
    sampling = copy.deepcopy(lm.generation_config)
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
    if policy.value_head is not None:
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()},
            str(directory / VALUE_HEAD_FILE),
        )
