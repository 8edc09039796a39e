"""What the params ask of the base model, checked against its skeleton before anything trains.

The base model's depth, module names, widths and context decide which values can train it:
``ppo.freeze_layers``, ``ppo.lora``, ``reward.train.num_layers`` and the query + response length;
its vocabulary, which ``task.truncate_token`` must be one token of.
The rules live here, below training and the stages, so that the ``base_model`` stage checks them
as soon as it has built the model (stage 1 of 9, not at stage 7 after the corpus, the labels and
the reward model), ``train_policy`` again before it loads a weight, and ``rlhf check-params``
whenever ``models/base`` is there. Each problem is one ``key: value ...`` line naming the model's
fact it conflicts with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from rlhf_pipeline.models import backbone_of, context_problem, transformer_layers
from rlhf_pipeline.tokens import single_token_problem

if TYPE_CHECKING:
    from rlhf_pipeline.params.ppo import PPOParams


def _is_linear(module: nn.Module) -> bool:
    """A linear layer a LoRA adapter can wrap: ``nn.Linear``, or GPT-2's ``Conv1D``."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def linear_layer_names(block: nn.Module) -> list[str]:
    """The last names of the linear layers of a transformer block (what ``'all-linear'`` adapts)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in block.named_modules() if _is_linear(module)})


# --------------------------------------------------------------------------------------------
# what the params ask of the base model
# --------------------------------------------------------------------------------------------
def ppo_fit_problems(cfg: PPOParams, model: nn.Module, where: str) -> list[str]:
    """Why ``cfg`` cannot train ``model`` (a skeleton is enough: only names and shapes are read),
    one ``key: value ...`` line each naming the model's fact it conflicts with; [] when it can.

    - ``freeze_layers`` must leave the top block trainable: with every block frozen a LoRA adapter
      has nowhere to go, and the policy and reference would run different paths for one model;
    - each ``lora.target_modules`` entry must name (as peft matches names: the module's name or
      its last dotted parts) linear layers inside the trained blocks: not a norm or an MLP, and not
      ``lm_head`` (outside the blocks, and tied to the frozen embeddings in most small LMs);
    - ``lora.rank`` at most the smaller side of every adapted layer: past it the adapter only
      adds parameters."""
    if cfg.freeze_layers == 0 and cfg.lora is None:
        return []
    layers = transformer_layers(backbone_of(model), "ppo.lora" if cfg.lora is not None else "ppo.freeze_layers")
    depth, name = len(layers), type(model).__name__
    if cfg.freeze_layers >= depth:
        return [
            f"ppo.freeze_layers: {cfg.freeze_layers}, but the base model ({where}, {name}) has {depth} blocks; at "
            f"most {depth - 1}, so the top block trains (with every block frozen LoRA has no block to adapt and "
            "the policy and its reference would be computed by different paths)"
        ]
    if cfg.lora is None:
        return []
    trained = layers[cfg.freeze_layers :]
    linear = linear_layer_names(trained[0])
    span = f"blocks {cfg.freeze_layers}-{depth - 1} of the base model ({where}, {name})"
    if not linear:
        return [f"ppo.lora: the trained {span} hold no linear layer for an adapter; set ppo.lora: null"]
    targets = linear if cfg.lora.target_modules == "all-linear" else cfg.lora.target_modules
    problems, widths = [], {}
    for target in targets:
        matched = [
            module
            for block in trained
            for module_name, module in block.named_modules()
            if module_name == target or module_name.endswith("." + target)
        ]
        if not matched:
            problems.append(
                f"ppo.lora.target_modules: {target!r} names no module of the trained {span}; their linear "
                f"layers are {', '.join(linear)} (or 'all-linear')"
            )
        elif not all(_is_linear(module) for module in matched):
            kind = next(type(module).__name__ for module in matched if not _is_linear(module))
            problems.append(
                f"ppo.lora.target_modules: {target!r} is a {kind} in the {span}, not a linear layer; LoRA adapts "
                f"the linear layers {', '.join(linear)}"
            )
        else:
            widths[target] = min(min(module.weight.shape) for module in matched)
    narrowest = min(widths, key=widths.get, default=None)
    if narrowest is not None and cfg.lora.rank > widths[narrowest]:
        problems.append(
            f"ppo.lora.rank: {cfg.lora.rank}, more than the width {widths[narrowest]} of {narrowest!r} in the "
            f"{span} (the smaller side of its weight); a rank above min(in, out) adds parameters and no "
            f"expressiveness: at most {widths[narrowest]}"
        )
    return problems


def reward_layers_problem(num_layers: int | None, model: nn.Module, where: str) -> str | None:
    """``reward.train.num_layers`` (the reward model keeps the lowest blocks) beyond the model's depth."""
    if num_layers is None:
        return None
    depth = len(transformer_layers(backbone_of(model), "reward.train.num_layers"))
    if num_layers > depth:
        return (
            f"reward.train.num_layers: {num_layers}, but the base model ({where}, {type(model).__name__}) has "
            f"{depth} blocks; at most {depth} (null: all of them)"
        )
    return None


def model_fit_problems(
    model: nn.Module,
    where: str,
    ppo: PPOParams,
    reward_num_layers: int | None,
    query_length: int,
    response_length: int,
    tokenizer=None,
    truncate_token: str | None = None,
) -> list[str]:
    """Every problem of the params against ``model`` (a skeleton or the built model) and its
    ``tokenizer`` (its vocabulary: ``task.truncate_token`` must be one of its tokens)."""
    problems = ppo_fit_problems(ppo, model, where)
    problems += [p for p in (reward_layers_problem(reward_num_layers, model, where),) if p]
    problems += [p for p in (context_problem(model.config, query_length, response_length, where),) if p]
    if tokenizer is not None and truncate_token is not None:
        problem = single_token_problem(tokenizer, truncate_token, "task.truncate_token")
        problems += [f"{problem} (the base model's tokenizer, {where})"] if problem else []
    return problems
