"""The reward model: a transformer backbone plus a scalar head, normalised by a stored gain and bias,
and how it scores (one module, one job: scoring; saving, building and training live beside it).

Faithful to lm-human-preferences:

- the head reads the hidden state of the last real token of query+response (``pooling='last'``,
  the reference); ``pooling='mean'`` reads the mean hidden state over the response tokens instead
  (an option for small label budgets: on the CPU profile's 512 labels it generalises better);
- head weight ~ N(0, 1/sqrt(d_model + 1)), bias 0 (OAI ``fc_layer``);
- ``reward = gain * head(h_last) + bias`` with ``gain``/``bias`` stored with the model (init 1, 0)
  and set by :func:`rlhf_pipeline.reward.normalization.fit_normalization` so base-model samples
  have a target mean and std.

Best-of-N rows share their query: :meth:`RewardModel.score_best_of_n` packs a query and its N
responses into one sequence with a block attention mask, so the query is computed once for all N
(gradients flow through the shared prefix) in a single forward pass. That is where most of this
project's speed over a trainer that concatenates the query to every response comes from.
"""

from __future__ import annotations

import math
from typing import get_args

import torch
from torch import Tensor, nn

from rlhf_pipeline.decoding import position_ids_from_mask
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.params.reward import RewardPooling
from rlhf_pipeline.tokens import encode_start, special_prefix

POOLINGS = get_args(RewardPooling)


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
        self.tokenizer = None  # set by load_reward_model() from the model's folder; score() needs it

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
        device = self.head.weight.device  # the caller's token ids may sit on the CPU
        queries, samples = queries.to(device), samples.to(device)
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
            raise PipelineError(
                "RewardModel.score needs a tokenizer: load the model with "
                "rlhf_pipeline.reward.persistence.load_reward_model(path)."
            )
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
