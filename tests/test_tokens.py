"""The tokenizer's own prefix (a BOS) starts every sequence the project builds, once, and nothing
changes for a tokenizer without one (SmolLM2, the default): queries, user labels, corpus prompts
and the reward model's text scorer lay the ids out alike on Llama-, Mistral- and Gemma-style
models."""

from __future__ import annotations

import pytest
import torch
from conftest import sampling_request
from families import tiny_backbone, tiny_causal_lm
from tokenizers.processors import TemplateProcessing

from rlhf_pipeline.corpus import encode_prompt
from rlhf_pipeline.preferences.formats import pairwise_to_internal, tokenize_response
from rlhf_pipeline.queries import build_chat_queries, build_queries, tokenize_query
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.sampling import response_outputs, sample_responses
from rlhf_pipeline.sources import build_tiny_tokenizer
from rlhf_pipeline.tokens import encode_start, special_prefix

PASSAGES = [
    "Intro words. The movie was wonderful and I loved it. The actors were great.",
    "Some start. This was a terrible day and everything went wrong. I hate the rain.",
    "Before that. She walked to the market. He bought bread and milk.",
    "Then. The weather is fine and the sky is blue. Birds sing every morning.",
]


def bos_tokenizer():
    """The tiny byte-level BPE with Llama's habit: ``<bos>`` before every encoded text."""
    tokenizer = build_tiny_tokenizer(vocab_size=200)
    tokenizer.add_special_tokens({"bos_token": "<bos>", "pad_token": "<pad>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return tokenizer


def plain_tokenizer():
    """As SmolLM2's: nothing before a text, a pad token of its own."""
    tokenizer = build_tiny_tokenizer(vocab_size=200)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def test_the_prefix_is_what_the_tokenizer_itself_adds():
    bos = bos_tokenizer()
    assert special_prefix(bos) == [bos.bos_token_id]
    assert bos.encode("The movie") == special_prefix(bos) + bos.encode("The movie", add_special_tokens=False)
    assert special_prefix(plain_tokenizer()) == []


def test_queries_start_with_one_bos_after_the_padding():
    tokenizer = bos_tokenizer()
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    splits, counts = build_queries(PASSAGES, tokenizer, 64, ".", ".", 0.5, seed=0)
    assert counts["kept"] == 4
    for columns in splits.values():
        for ids, text in zip(columns["query_ids"], columns["query"]):
            real = [i for i in ids if i != pad]
            assert len(ids) == 64 and real[0] == bos and real.count(bos) == 1
            assert ids[: len(ids) - len(real)] == [pad] * (len(ids) - len(real))  # left padding only
            assert "<bos>" not in text and tokenizer.decode(real[1:]) == text


def test_a_tokenizer_without_a_prefix_gives_the_ids_it_gave_before():
    tokenizer = plain_tokenizer()
    text = PASSAGES[0]
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert tokenize_query(tokenizer, text, 8)[-8:] == plain[-8:]
    assert encode_start(tokenizer, text) == plain
    assert encode_prompt(tokenizer, "Hi.") == tokenizer.encode("Hi.\n", add_special_tokens=False)


def test_a_cut_prompt_keeps_its_bos_and_its_end():
    tokenizer = bos_tokenizer()
    ids = tokenize_query(tokenizer, PASSAGES[0], 6)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids[1:] == tokenizer.encode(PASSAGES[0], add_special_tokens=False)[-5:]


def test_a_chat_template_that_writes_the_bos_gets_no_second_one():
    tokenizer = bos_tokenizer()
    tokenizer.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    bos = tokenizer.bos_token_id
    splits, _ = build_chat_queries([[{"role": "user", "content": p}] for p in PASSAGES], tokenizer, 40, 0.5, seed=0)
    for ids in splits["train"]["query_ids"] + splits["test"]["query_ids"]:
        assert [i for i in ids if i != tokenizer.pad_token_id][0] == bos and ids.count(bos) == 1
    assert encode_prompt(tokenizer, "Hi.").count(bos) == 1 and encode_prompt(tokenizer, "Hi.")[0] == bos
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # writes none
    assert encode_prompt(tokenizer, "Hi.")[0] == bos and encode_prompt(tokenizer, "Hi.").count(bos) == 1


def test_user_labels_are_laid_out_as_the_queries_stage_lays_them():
    import pandas as pd

    tokenizer = bos_tokenizer()
    frame = pd.DataFrame({"prompt": PASSAGES[:2], "chosen": [" Lovely.", " Great."], "rejected": [" Awful.", " Bad."]})
    columns = pairwise_to_internal(frame, tokenizer, 16, 6)
    assert columns["query_ids"] == [tokenize_query(tokenizer, p, 16) for p in PASSAGES[:2]]
    assert all(ids[0] != tokenizer.bos_token_id for row in columns["sample_ids"] for ids in row)  # replies continue


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gemma3_text"])
def test_the_text_scorer_reads_the_ids_the_pipeline_trains_on(model_type):
    """``RewardModel.score`` (text, as the model card shows) gives the scores of the id layout that
    the queries stage, the sampler, PPO and the evaluation use: the BOS first, once."""
    tokenizer = bos_tokenizer()
    torch.manual_seed(0)
    model = RewardModel(tiny_backbone(model_type), tokenizer.pad_token_id, "last").eval()
    model.tokenizer = tokenizer
    queries, replies = PASSAGES[:3], [" It was fine.", " Not good at all.", " Lovely."]
    # lengths that cut nothing: score() reads whole texts
    query_ids = torch.tensor([tokenize_query(tokenizer, q, 96) for q in queries])
    reply_ids = torch.tensor([tokenize_response(tokenizer, r, 24) for r in replies])
    expected = model.score_best_of_n(query_ids, reply_ids[:, None, :])[:, 0]
    torch.testing.assert_close(torch.tensor(model.score(queries, replies)), expected, atol=1e-5, rtol=1e-5)
    # the BOS is read: the layouts are told apart (texts short enough for the 8-token sliding windows)
    short_queries = torch.tensor([tokenize_query(tokenizer, q, 4) for q in ("Hi.", "No.")])
    short_replies = torch.tensor([tokenize_response(tokenizer, " Ok.", 4)] * 2)[:, None, :]
    with_bos = model.score_best_of_n(short_queries, short_replies)
    no_bos = model.score_best_of_n(
        short_queries.masked_fill(short_queries == tokenizer.bos_token_id, tokenizer.pad_token_id), short_replies
    )
    assert not torch.allclose(no_bos, with_bos)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gemma3_text"])
def test_the_sampler_and_the_training_forward_read_the_same_bos_led_ids(model_type):
    """The ids data/queries stores (left padding, then one BOS) are what the sampler continues and
    what PPO's training forward (the reference's and the evaluation's KL too: one path) scores: the
    sampled tokens' logprobs agree, on each family whose tokenizer adds a BOS."""
    tokenizer = bos_tokenizer()
    pad = tokenizer.pad_token_id
    lm = tiny_causal_lm(model_type)
    queries = torch.tensor([tokenize_query(tokenizer, q, 12) for q in ("Hi.", "The film was fine.", "No.")])
    assert all(row[row != pad][0] == tokenizer.bos_token_id for row in queries)
    out = sample_responses(lm, sampling_request(queries, queries != pad, 5, 0.7, pad, torch.Generator().manual_seed(0)))
    query_responses = torch.cat([queries, out.responses], 1)
    with torch.no_grad():
        trained = response_outputs(lm, query_responses, query_responses != pad, queries.shape[1], 0.7, pad)
    torch.testing.assert_close(trained.logprobs, out.logprobs, atol=1e-4, rtol=1e-4)
