"""Reward model: a transformer backbone plus a scalar head, normalised by a stored gain and bias.

Faithful to lm-human-preferences:

- the head reads the hidden state of the last real token of query+response (``pooling='last'``,
  the reference); ``pooling='mean'`` reads the mean hidden state over the response tokens instead
  (an option for small label budgets: on the CPU profile's 512 labels it generalises better);
- head weight ~ N(0, 1/sqrt(d_model + 1)), bias 0 (OAI ``fc_layer``);
- ``reward = gain * head(h_last) + bias`` with ``gain``/``bias`` stored with the model (init 1, 0)
  and set by :func:`fit_normalization` so base-model samples have a target mean and std;
- training: softmax cross-entropy over the N samples against ``best`` (pairwise Bradley-Terry is
  N=2), one epoch, learning rate annealed linearly to 0.

Best-of-N rows share their query: :meth:`RewardModel.score_best_of_n` packs a query and its N
responses into one sequence with a block attention mask, so the query is computed once for all N
(gradients flow through the shared prefix) in a single forward pass. That is where most of this
project's speed over a trainer that concatenates the query to every response comes from.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import NamedTuple, get_args

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm

from rlhf_pipeline import distributed
from rlhf_pipeline.errors import NonFiniteError, PipelineError
from rlhf_pipeline.functional import apply_penalty, linear_anneal
from rlhf_pipeline.io import LOCAL_MODELS, local_model_dir
from rlhf_pipeline.models import set_dropout, transformer_layers
from rlhf_pipeline.optim import adam
from rlhf_pipeline.params.reward import RewardPooling, RewardTrainParams
from rlhf_pipeline.sampling import iterate_batches, position_ids_from_mask
from rlhf_pipeline.tokens import encode_start, special_prefix
from rlhf_pipeline.training import accumulate_and_step, set_lr

HEAD_FILE = "reward_head.safetensors"
POOLINGS = get_args(RewardPooling)
POOLING_DESCRIPTIONS = {"last": "last non-pad token", "mean": "mean over response tokens"}
CONFIG_FILE = "reward_config.json"
BACKBONE_DIR = "backbone"  # where a mean-pooling model's backbone goes (no stock class computes it)
# config.json of a mean-pooling model: no stock class computes its score, so a stock load must fail,
# and transformers' message quotes the model type: it names the loader to use
UNLOADABLE_MODEL_TYPE = "rlhf_pipeline_mean_pooled_reward (load it with rlhf_pipeline.reward.RewardModel.load)"
OFFSET_KEY = "reward_offset"  # in config.json of a stock export: normalised score = logits + this


def init_reward_head(head: nn.Linear, generator: torch.Generator | None = None) -> None:
    """OAI ``fc_layer``: w ~ N(0, 1/sqrt(d_in + 1)), b = 0."""
    d_in = head.weight.shape[1]
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / math.sqrt(d_in + 1), generator=generator)
        head.bias.zero_()


class RewardModel(nn.Module):
    def __init__(self, backbone: nn.Module, pad_token_id: int, pooling: str = "last"):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.backbone = backbone
        self.pad_token_id = pad_token_id
        self.pooling = pooling
        self.head = nn.Linear(backbone.config.hidden_size, 1)
        init_reward_head(self.head)
        # Parameters, as in both references: normalisation sets them, and reward training also
        # trains them (reward.train.train_gain_bias); they travel with the weights.
        # one-element vectors, not scalars: FSDP shards no 0-d parameter
        self.gain = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))
        self.tokenizer = None  # set by load() from the model's folder; score() needs it

    # ----------------------------------------------------------------------------------------
    def normalize(self, raw: Tensor) -> Tensor:
        return self.gain * raw + self.bias

    def raw_scores(self, query_responses: Tensor, query_length: int | None = None) -> Tensor:
        """Unnormalised head output of each row of query+response (B,): at the last non-pad token,
        or (``pooling='mean'``, which needs ``query_length``) the mean over the response tokens."""
        mask = query_responses != self.pad_token_id
        hidden = self.backbone(
            input_ids=query_responses,
            attention_mask=mask.long(),
            position_ids=position_ids_from_mask(mask),
            use_cache=False,
        ).last_hidden_state
        if self.pooling == "mean":
            if query_length is None:
                raise ValueError("pooling='mean' needs query_length to find the response tokens")
            response_mask = mask.clone()
            response_mask[:, :query_length] = False
        last = last_true_index(mask)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        if self.pooling == "mean":
            # an empty response is scored at the query's last token, as score_best_of_n does
            empty = ~response_mask.any(-1, keepdim=True)
            pooled = torch.where(empty, pooled, masked_mean_hidden(hidden, response_mask))
        return self.head(pooled).squeeze(-1).float()

    def forward(self, query_responses: Tensor, query_length: int | None = None) -> Tensor:
        return self.normalize(self.raw_scores(query_responses, query_length))

    def score_best_of_n(self, queries: Tensor, samples: Tensor, normalized: bool = True) -> Tensor:
        """Rewards of ``samples`` (B, N, R) as continuations of ``queries`` (B, Q): (B, N).

        Each row is packed into one sequence ``[query, sample_1, ..., sample_N]`` whose attention
        mask (:func:`packed_best_of_n_mask`) lets sample k see only the query and itself, with
        positions that continue the query. The query is therefore computed once and shared by the N
        samples (gradients flow into it from all of them), in a single forward pass whose scores
        equal :meth:`forward` on each concatenated query+sample. A model with sliding-window
        attention whose window is shorter than the packed row scores each query+sample on its own.
        """
        batch, n, resp_len = samples.shape
        query_len = queries.shape[1]
        window = attention_window(self.backbone.config)
        if window is not None and query_len + n * resp_len > window:
            # A packed row longer than the sliding window would see keys (by index) that scoring alone
            # would not, and vice versa: the mask cannot say both, so score each query + sample alone.
            joined = torch.cat([queries.repeat_interleave(n, 0), samples.reshape(batch * n, resp_len)], 1)
            raw = self.raw_scores(joined, query_len).view(batch, n)
            return self.normalize(raw) if normalized else raw
        q_mask = queries != self.pad_token_id
        r_mask = samples != self.pad_token_id
        q_positions = position_ids_from_mask(q_mask)
        r_positions = q_mask.sum(-1, keepdim=True) + torch.arange(resp_len, device=samples.device)
        allowed = packed_best_of_n_mask(q_mask, r_mask)
        if self.backbone.config._attn_implementation != "sdpa":
            # eager attention adds the mask to the scores: it needs 0 / -inf, not booleans.
            dtype = next(self.backbone.parameters()).dtype
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
        hidden = self.backbone(
            input_ids=torch.cat([queries, samples.reshape(batch, n * resp_len)], dim=1),
            attention_mask=allowed,
            position_ids=torch.cat([q_positions, r_positions.repeat(1, n)], dim=1),
            use_cache=False,
        ).last_hidden_state
        response_hidden = hidden[:, query_len:].reshape(batch, n, resp_len, -1)
        resp_lens = r_mask.sum(-1)
        if self.pooling == "mean":
            pooled = masked_mean_hidden(response_hidden.flatten(0, 1), r_mask.flatten(0, 1)).view(batch, n, -1)
        else:
            index = (resp_lens - 1).clamp(min=0)[..., None, None].expand(batch, n, 1, response_hidden.shape[-1])
            pooled = response_hidden.gather(2, index).squeeze(2)
        # An empty response (all padding) is scored at the query's last token.
        h_query_last = hidden[:, query_len - 1, None, :].expand_as(pooled)
        pooled = torch.where((resp_lens == 0)[..., None], h_query_last, pooled)
        raw = self.head(pooled).squeeze(-1).float()
        return self.normalize(raw) if normalized else raw

    @torch.no_grad()
    def score(self, queries: list[str], responses: list[str]) -> list[float]:
        """The normalised reward of each ``responses[i]`` as a continuation of ``queries[i]``, from text.

        Queries start with the tokenizer's own prefix (a BOS, as data/queries does), replies have
        none; queries padded on the left and responses on the
        right, as the pipeline lays out query + response; PPO's penalty for a response the task's
        truncation rule refuses is not applied here (see :func:`task_scores`)."""
        if self.tokenizer is None:
            raise PipelineError("RewardModel.score needs a tokenizer: load the model with RewardModel.load(path).")
        if len(queries) != len(responses):
            raise ValueError(f"score: {len(queries)} queries but {len(responses)} responses")
        device = self.head.weight.device

        prefix = special_prefix(self.tokenizer)

        def padded(texts: list[str], left: bool) -> Tensor:
            # a query starts a sequence (the tokenizer's prefix, a BOS, first); a reply continues it
            ids = [
                encode_start(self.tokenizer, t, prefix=prefix)
                if left
                else self.tokenizer.encode(t, add_special_tokens=False)
                for t in texts
            ]
            width = max(1, *(len(row) for row in ids))
            fill = [[self.pad_token_id] * (width - len(row)) for row in ids]
            rows = [pad + row if left else row + pad for row, pad in zip(ids, fill)]
            return torch.tensor(rows, dtype=torch.long, device=device)

        queries_t, responses_t = padded(queries, left=True), padded(responses, left=False)
        return self.score_best_of_n(queries_t, responses_t[:, None, :])[:, 0].tolist()

    # ----------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """The backbone and head as Hugging Face files, and the project's own head file (raw head,
        gain, bias), which :meth:`load` reads.

        ``pooling='last'`` writes a stock ``<Arch>ForSequenceClassification`` (see
        :meth:`as_sequence_classifier`), so ``AutoModelForSequenceClassification`` loads it.
        ``pooling='mean'`` has no stock class: the backbone goes in ``backbone/`` and the folder's
        ``config.json`` names a model type no library knows, so a stock load fails loudly, naming
        :meth:`load`, instead of adding a random head.
        """
        directory = Path(directory)
        if self.pooling == "last":
            self.as_sequence_classifier().save_pretrained(directory)
        else:
            self.backbone.save_pretrained(directory / BACKBONE_DIR)
            (directory / "config.json").write_text(json.dumps({"model_type": UNLOADABLE_MODEL_TYPE}, indent=2) + "\n")
        tensors = {
            "head.weight": self.head.weight.detach().cpu().contiguous(),
            "head.bias": self.head.bias.detach().cpu().contiguous(),
            "gain": self.gain.detach().cpu().reshape(1),
            "bias": self.bias.detach().cpu().reshape(1),
        }
        save_file(tensors, str(directory / HEAD_FILE))
        stock = {"stock_class": f"AutoModelForSequenceClassification, plus config.{OFFSET_KEY}"}
        (directory / CONFIG_FILE).write_text(
            json.dumps(
                {
                    "pad_token_id": self.pad_token_id,
                    "gain": self.gain.item(),
                    "bias": self.bias.item(),
                    "pooling": self.pooling,
                    "head": POOLING_DESCRIPTIONS[self.pooling],
                    **(stock if self.pooling == "last" else {"backbone": BACKBONE_DIR}),
                },
                indent=2,
            )
            + "\n"
        )

    def offset(self) -> float:
        """The constant of the normalised score: ``gain * head.bias + bias``."""
        return (self.gain * self.head.bias[0] + self.bias).item()

    def as_sequence_classifier(self):
        """The stock ``<Arch>ForSequenceClassification`` (one label) on this backbone, scoring the
        last non-pad token with ``score.weight = gain * head.weight``: the normalised score minus
        :meth:`offset`, which ``config.reward_offset`` records. The stock head of Llama-family models
        has no bias, and the final RMSNorm before it leaves no constant direction to carry one, so
        the constant cannot be folded into the weights. Inputs must not be left-padded: the stock
        class numbers positions from the first column, this model from the first real token.
        """
        from transformers import AutoModelForSequenceClassification

        if self.pooling != "last":
            raise ValueError(f"pooling={self.pooling!r} has no stock Hugging Face class; only 'last' does")
        config = copy.deepcopy(self.backbone.config)
        config.num_labels, config.architectures, config.pad_token_id = 1, None, self.pad_token_id
        setattr(config, OFFSET_KEY, self.offset())
        model = AutoModelForSequenceClassification.from_config(config, dtype=self.head.weight.dtype)
        model.base_model.load_state_dict(self.backbone.state_dict())
        with torch.no_grad():
            model.score.weight.copy_(self.gain * self.head.weight)
        return model.eval()

    @classmethod
    def from_base(
        cls,
        base_dir: str | Path,
        pad_token_id: int,
        dropout: float = 0.0,
        generator: torch.Generator | None = None,
        pooling: str = "last",
        num_layers: int | None = None,
    ) -> RewardModel:
        """A reward model on the base model's backbone, or (``num_layers``) on its lowest blocks only:
        the head then reads the final norm of the state after block ``num_layers``."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32)
        if num_layers is not None:
            layers = transformer_layers(backbone, "reward.train.num_layers")
            if not 0 <= num_layers <= len(layers):
                raise PipelineError(
                    f"reward.train.num_layers is {num_layers} but the base model has {len(layers)} blocks."
                )
            del layers[num_layers:]
            backbone.config.num_hidden_layers = num_layers
            if isinstance(getattr(backbone.config, "layer_types", None), list):
                backbone.config.layer_types = backbone.config.layer_types[:num_layers]
        set_dropout(backbone, dropout)
        model = cls(backbone, pad_token_id, pooling)
        init_reward_head(model.head, generator)
        return model

    @classmethod
    def from_sequence_classifier(cls, source: str, tokenizer) -> RewardModel:
        """Adopt an existing one-label ``AutoModelForSequenceClassification`` (local directory or hub
        id) that shares the base model's tokenizer: its backbone, its ``score`` as the head (bias 0
        where it has none), gain 1 and bias ``config.reward_offset`` (0 where unset), last-token pooling.
        The pipeline's dedicated pad token gets an embedding row if the model lacks one (pads are
        never attended)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        where = f"reward.pretrained ({source!r})"
        local_model_dir(source, "reward.pretrained")  # a local folder must be one DVC tracks
        try:
            stock = AutoModelForSequenceClassification.from_pretrained(source, dtype=torch.float32)
            theirs = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as error:
            raise PipelineError(
                f"{where} could not be loaded as a sequence-classification model with its tokenizer: {error}. "
                f"Give a local directory in {LOCAL_MODELS}/ or a hub id already in the local Hugging Face cache (the "
                "pipeline runs offline) holding config.json, the weights and the tokenizer files."
            ) from None
        if stock.config.num_labels != 1:
            raise PipelineError(f"{where} has {stock.config.num_labels} labels; a reward model has one (a scalar).")
        ours = tokenizer.get_vocab()
        differing = sorted(t for t, i in theirs.get_vocab().items() if ours.get(t) != i)
        if differing:
            raise PipelineError(
                f"{where} uses a different tokenizer from the base model: {len(differing)} of its "
                f"{len(theirs)} tokens have another id or none in the base tokenizer (e.g. {differing[:5]}). "
                "The reward model scores the policy's token ids, so it must share the base model's vocabulary."
            )
        head = getattr(stock, "score", None)
        if not isinstance(head, nn.Linear):
            raise PipelineError(
                f"{where} is a {type(stock).__name__}, whose head is not a linear `score` layer on the last "
                "token's state (the decoder-model classifiers' layout), so it cannot be adopted as is."
            )
        backbone = stock.base_model
        if backbone.get_input_embeddings().num_embeddings < len(tokenizer):
            backbone.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        model = cls(backbone, tokenizer.pad_token_id, "last")
        with torch.no_grad():
            model.head.weight.copy_(head.weight)
            model.head.bias.copy_(head.bias if head.bias is not None else torch.zeros(1))
            model.bias.fill_(float(getattr(stock.config, OFFSET_KEY, 0.0) or 0.0))
        return model

    @classmethod
    def load(cls, directory: str | Path, device: torch.device | str = "cpu") -> RewardModel:
        from transformers import AutoModel

        directory = Path(directory)
        if not (directory / HEAD_FILE).is_file():
            raise PipelineError(
                f"'{directory}' is not a reward model directory (no {HEAD_FILE}); run `dvc repro train_reward` first."
            )
        config = json.loads((directory / CONFIG_FILE).read_text())
        # mean pooling keeps the backbone in backbone/; last pooling is a stock sequence classifier,
        # whose backbone AutoModel reads (its score.weight is the head file's gain * weight)
        backbone_dir = directory / BACKBONE_DIR if (directory / BACKBONE_DIR).is_dir() else directory
        backbone = AutoModel.from_pretrained(str(backbone_dir), dtype=torch.float32)
        model = cls(backbone, config["pad_token_id"], config.get("pooling", "last"))
        tensors = load_file(str(directory / HEAD_FILE))
        with torch.no_grad():
            model.head.weight.copy_(tensors["head.weight"])
            model.head.bias.copy_(tensors["head.bias"])
            model.gain.copy_(tensors["gain"][0])
            model.bias.copy_(tensors["bias"][0])
        if (directory / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            model.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        return model.to(device).eval()


def masked_mean_hidden(hidden: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``hidden`` (B, T, D) over the True positions of ``mask`` (B, T): (B, D); 0 for an empty row."""
    weights = mask.to(hidden.dtype)[..., None]
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def last_true_index(mask: Tensor) -> Tensor:
    """Index of the last True in each row of a (B, T) mask (0 if none)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.zeros_like(positions)).max(dim=1).values


def attention_window(config) -> int | None:
    """The sliding attention window of a model (Mistral, Gemma2/3, Phi3, Qwen2 with
    ``use_sliding_window``), or None when every layer attends to the whole sequence."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and not any("sliding" in str(kind) for kind in layer_types):
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def packed_best_of_n_mask(query_mask: Tensor, response_mask: Tensor) -> Tensor:
    """Attention mask (B, 1, L, L), True = may attend, for rows packed as
    ``[query (Q), response_1 (R), ..., response_N (R)]`` with L = Q + N*R.

    Token i may attend key j iff j <= i (causal), j is not padding, and j is in the query or in
    the same response as i. That is exactly what each query+response_k sees on its own. Every token
    also attends itself, so padded positions never have an empty row (their outputs are unused).

    ``query_mask`` (B, Q) and ``response_mask`` (B, N, R) are True at real tokens.
    """
    batch, n, resp_len = response_mask.shape
    query_len = query_mask.shape[1]
    device = query_mask.device
    # segment 0 = query, k = response k (1-based)
    segment = torch.cat(
        [
            torch.zeros(query_len, dtype=torch.long, device=device),
            torch.arange(1, n + 1, device=device).repeat_interleave(resp_len),
        ]
    )
    length = segment.numel()
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    visible = (segment[None, :] == 0) | (segment[None, :] == segment[:, None])
    key_is_real = torch.cat([query_mask, response_mask.reshape(batch, n * resp_len)], dim=1)
    allowed = (causal & visible)[None] & key_is_real[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def set_gain_bias(model: RewardModel, gain: float, bias: float) -> None:
    with torch.no_grad():
        model.gain.fill_(gain)
        model.bias.fill_(bias)


# --------------------------------------------------------------------------------------------
# the loss and the normalisation, as pure functions
# --------------------------------------------------------------------------------------------
def best_of_n_loss(rewards: Tensor, best: Tensor, margin: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reward-model loss for "which of N responses is best" labels (OAI's ``best`` label).

    .. math::
        z_{b,i} = r_{b,i} - m_b\\,[i = y_b],\\qquad
        L = -\\frac1B \\sum_b \\log \\mathrm{softmax}(z_b)_{y_b}

    Why: Ziegler et al. train the reward model as the logits of a softmax over the ``N``
    candidates, so the labelled response gets the highest reward. For ``N = 2`` this is the
    Bradley-Terry loss ``-log sigmoid(r_c - r_r - m)`` (``pairwise_loss``). The optional margin
    (Llama-2 style) asks the chosen reward to win by at least ``m``.

    Returns:
        ``(loss, accuracy)``; accuracy is ``mean(argmax_i r_{b,i} == y_b)`` on the raw rewards,
        detached.
    """
    best = best.long()
    logits = rewards
    if margin is not None:
        one_hot = F.one_hot(best, num_classes=rewards.size(-1)).to(rewards.dtype)
        logits = rewards - margin.to(rewards.dtype).unsqueeze(-1) * one_hot
    loss = F.cross_entropy(logits, best)
    accuracy = (rewards.detach().argmax(dim=-1) == best).to(rewards.dtype).mean()
    return loss, accuracy


def pairwise_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None) -> Tensor:
    """Bradley-Terry pairwise loss, mean over the batch.

    .. math:: L = -\\frac1B\\sum_b \\log\\sigma(r^c_b - r^r_b - m_b)

    Why: the two-candidate case of ``best_of_n_loss`` (softmax over two logits is the
    sigmoid of their difference), written directly with ``logsigmoid`` for stability.
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    return -F.logsigmoid(diff).mean()


def normalization_gain_bias(
    mean: float | Tensor,
    std: float | Tensor,
    target_mean: float = 0.0,
    target_std: float = 1.0,
) -> tuple[float, float]:
    """Gain and bias that map rewards with ``(mean, std)`` to ``(target_mean, target_std)``.

    .. math:: g = \\sigma_T / \\sigma_D,\\qquad b = \\mu_T - g\\,\\mu_D

    Why: OAI normalises the reward model before and after training so that ``g r + b`` has
    mean 0 and std 1 on responses sampled from the reference policy, which keeps the reward
    scale (and so the meaning of the KL coefficient) fixed.
    """
    mean = float(mean)
    std = float(std)
    if not std > 0:
        raise ValueError(f"normalization_gain_bias: std must be positive, got {std}")
    gain = float(target_std) / std
    bias = float(target_mean) - gain * mean
    return gain, bias


# --------------------------------------------------------------------------------------------
# scoring, normalisation and training
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def score_query_responses(
    model: RewardModel, queries: Tensor, responses: Tensor, batch_size: int, normalized: bool = True
) -> Tensor:
    """Rewards of single responses (B, R) to queries (B, Q), batched: (B,)."""
    scores = [
        model.score_best_of_n(queries[rows], responses[rows, None, :], normalized)[:, 0]
        for rows in iterate_batches(len(queries), batch_size)
    ]
    return torch.cat(scores)


def task_scores(
    model: RewardModel, queries: Tensor, truncated: Tensor, valid: Tensor, penalty_reward: float, batch_size: int
) -> Tensor:
    """The score of each response as the task defines it (one rule for PPO's rollouts and the
    evaluation): the normalised reward model's score of query + response truncated at
    ``task.truncate_token`` (``truncated``), or ``penalty_reward`` where no truncate token was found
    (``valid`` false). ``(B, Q), (B, R), (B,) -> (B,)``."""
    return apply_penalty(score_query_responses(model, queries, truncated, batch_size), valid, penalty_reward)


def fit_normalization(
    model: RewardModel, raw_scores: Tensor, target_mean: float, target_std: float
) -> tuple[float, float]:
    """Set gain/bias so that ``gain * raw + bias`` has the target mean and std on ``raw_scores``."""
    mean, std = raw_scores.mean().item(), raw_scores.std(unbiased=False).item()
    if not math.isfinite(std) or std == 0.0:
        raise PipelineError(
            "Reward normalisation failed: the reward model gives the same score to every sample (std 0)."
        )
    gain, bias = normalization_gain_bias(mean, std, target_mean, target_std)
    set_gain_bias(model, gain, bias)
    return gain, bias


class Labels(NamedTuple):
    """Best-of-N labels as tensors: ``queries`` (B, Q) left-padded, ``samples`` (B, N, R)
    right-padded, ``best`` (B,) the index of the preferred sample, ``margin`` (B,) or None."""

    queries: Tensor
    samples: Tensor
    best: Tensor
    margin: Tensor | None = None


def preference_tensors(split, device: torch.device | str = "cpu") -> Labels:
    """The :class:`Labels` of a preferences split (margin 0 where the data has none)."""
    return Labels(
        queries=torch.tensor(split["query_ids"], dtype=torch.long, device=device),
        samples=torch.tensor(split["sample_ids"], dtype=torch.long, device=device),
        best=torch.tensor(split["best"], dtype=torch.long, device=device),
        margin=torch.tensor(split["margin"], dtype=torch.float32, device=device)
        if "margin" in split.column_names
        else torch.zeros(len(split["best"]), device=device),
    )


@torch.no_grad()
def best_of_n_accuracy(model: RewardModel, queries: Tensor, samples: Tensor, best: Tensor, batch_size: int) -> float:
    correct = 0
    for rows in iterate_batches(len(queries), batch_size):
        rewards = model.score_best_of_n(queries[rows], samples[rows])
        correct += (rewards.argmax(-1) == best[rows]).sum().item()
    return correct / max(len(queries), 1)


class BestOfNScorer(nn.Module):
    """:meth:`RewardModel.score_best_of_n` as a module's forward: the call DDP and FSDP wrap."""

    def __init__(self, model: RewardModel):
        super().__init__()
        self.model = model

    def forward(self, queries: Tensor, samples: Tensor) -> Tensor:
        return self.model.score_best_of_n(queries, samples)


def train_reward_model(
    model: RewardModel,
    labels: Labels,
    cfg: RewardTrainParams,
    generator: torch.Generator,
    log=None,
    accelerator=None,
) -> list[dict]:
    """OAI reward training: ``cfg.epochs`` passes (reference: 1) over shuffled labels, the learning
    rate annealed linearly from ``cfg.lr`` to 0 by label index, Adam (TensorFlow-style epsilon
    unless ``cfg.tensorflow_adam`` is false), microbatches of ``cfg.microbatch_size`` accumulated
    into steps of ``cfg.batch_size`` labels. The reward gain and bias train with the model unless
    ``cfg.train_gain_bias`` is false (the softmax loss is invariant to the bias, so only the gain, a
    temperature of the N-way choice, actually moves).

    Several processes (``accelerator``, from :func:`rlhf_pipeline.distributed.make_accelerator`):
    ``cfg.batch_size`` stays the global batch; each process takes its contiguous share of every
    batch and the gradients are averaged, so every step is the one-process step. With FSDP ``model``
    is left sharded: :func:`rlhf_pipeline.distributed.whole_model` gathers it.

    Returns one record per optimizer step (step, loss, accuracy, lr); ``log(record)`` is called too.
    """
    accelerator = accelerator or distributed.make_accelerator(torch.device("cpu"), stage="train_reward")
    if cfg.batch_size % accelerator.num_processes:
        raise PipelineError(
            f"reward.train.batch_size ({cfg.batch_size}) must split evenly over the {accelerator.num_processes} "
            "processes."
        )
    model.gain.requires_grad_(cfg.train_gain_bias)
    model.bias.requires_grad_(cfg.train_gain_bias)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = adam(trainable, lr=cfg.lr, eps=cfg.adam_eps, tensorflow=cfg.tensorflow_adam)
    scorer, optimizer = accelerator.prepare(BestOfNScorer(model), optimizer)
    num_labels = len(labels.best)
    steps_per_epoch = num_labels // cfg.batch_size
    history: list[dict] = []
    model.train()
    bar = tqdm(
        total=steps_per_epoch * cfg.epochs, desc="train_reward", unit="step", disable=not accelerator.is_main_process
    )
    for epoch in range(cfg.epochs):
        order = torch.randperm(num_labels, generator=generator)
        for start in range(0, steps_per_epoch * cfg.batch_size, cfg.batch_size):
            lr = linear_anneal(epoch * num_labels + start, num_labels * cfg.epochs, cfg.lr)
            set_lr(optimizer, lr)
            batch = order[start : start + cfg.batch_size]
            share = batch[distributed.share(accelerator, len(batch))]
            records = accumulate_and_step(
                accelerator,
                scorer,
                optimizer,
                share.split(cfg.microbatch_size),
                lambda micro: _label_loss(scorer, labels, micro),
                lambda what, detail: _non_finite(what, len(history), detail),
                cfg.max_grad_norm,
                model,
            )
            # loss and correct choices summed over every process's rows: the one-process figures
            sums = torch.zeros(2, dtype=torch.float64)
            for loss, accuracy, rows in records:
                sums += torch.tensor([loss, accuracy], dtype=torch.float64) * rows
            loss_sum, correct = distributed.sum_over_processes(accelerator, sums).tolist()
            record = {"step": len(history), "loss": loss_sum / len(batch), "accuracy": correct / len(batch), "lr": lr}
            history.append(record)
            if log is not None:
                log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.2f}")
    bar.close()
    model.eval()
    return history


def _label_loss(scorer: nn.Module, labels: Labels, micro: Tensor) -> tuple[Tensor, tuple[float, float, int]]:
    """The best-of-N loss of the labels ``micro`` indexes, and (loss, accuracy, rows) for the record."""
    rewards = scorer(labels.queries[micro], labels.samples[micro])
    margin = labels.margin[micro] if labels.margin is not None else None
    loss, accuracy = best_of_n_loss(rewards, labels.best[micro], margin)
    return loss, (loss.item(), accuracy.item(), len(micro))


def _non_finite(what: str, step: int, detail) -> NonFiniteError:
    if what == "loss":
        where, causes = "", "reward.train.lr too high, or extreme values in the preference data's margin column"
    else:
        where, causes = f" ({', '.join(detail[:3])}...)", "fp16/bf16 overflow (run in fp32) or reward.train.lr too high"
    return NonFiniteError(
        f"Reward-model {what} became non-finite at step {step}{where}; nothing was written. Likely causes: {causes}."
    )
