"""Reward model on the tiny Llama: head init, the shared-prefix scorer, normalisation, training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import run_stage_script

from rlhf_pipeline.errors import NonFiniteError, PipelineError
from rlhf_pipeline.models import freeze_lower_layers, load_tokenizer
from rlhf_pipeline.params.reward import RewardTrainParams
from rlhf_pipeline.reward.adoption import adopt_sequence_classifier, reward_model_on_base
from rlhf_pipeline.reward.model import init_reward_head, masked_mean_hidden, packed_best_of_n_mask
from rlhf_pipeline.reward.normalization import fit_normalization, score_query_responses
from rlhf_pipeline.reward.persistence import load_reward_model, reward_offset, save_reward_model, stock_classifier
from rlhf_pipeline.reward.training import Labels, best_of_n_accuracy, best_of_n_loss, train_reward_model


@pytest.fixture(scope="module")
def pad(tiny_base_dir):
    return load_tokenizer(tiny_base_dir).pad_token_id


def make_rm(tiny_base_dir, pad, pooling="last", seed=0):
    return reward_model_on_base(
        tiny_base_dir, pad, generator=torch.Generator().manual_seed(seed), pooling=pooling
    ).eval()


def batch(pad, rows=6, n=3, q=5, r=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randint(0, 250, (rows, q), generator=g)
    queries[:2, :2] = pad  # left padding
    samples = torch.randint(0, 250, (rows, n, r), generator=g)
    samples[0, -1, 2:] = pad  # a truncated (right-padded) response
    return queries, samples


def test_head_init_statistics():
    """OAI fc_layer: weight ~ N(0, 1/sqrt(d_in + 1)), bias 0. For d_in = 4095 the std is 1/64."""
    head = torch.nn.Linear(4095, 1000)
    init_reward_head(head, torch.Generator().manual_seed(0))
    assert head.bias.abs().max().item() == 0.0
    assert head.weight.mean().item() == pytest.approx(0.0, abs=1e-3)
    assert head.weight.std().item() == pytest.approx(1 / 64, rel=0.01)


def test_gain_and_bias_start_at_one_and_zero(tiny_base_dir, pad):
    rm = make_rm(tiny_base_dir, pad)
    assert rm.gain.item() == 1.0 and rm.bias.item() == 0.0
    raw = torch.tensor([0.5, -2.0])
    assert torch.equal(rm.normalize(raw), raw)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_shared_prefix_scores_equal_full_forward(tiny_base_dir, pad, pooling, attention):
    """score_best_of_n (query + N responses packed in one masked sequence) == forward on each query+response."""
    rm = make_rm(tiny_base_dir, pad, pooling)
    rm.backbone.set_attn_implementation(attention)
    queries, samples = batch(pad)
    fast = rm.score_best_of_n(queries, samples, normalized=False)
    rows, n, r = samples.shape
    concatenated = torch.cat([queries.repeat_interleave(n, 0), samples.reshape(rows * n, r)], 1)
    slow = rm.raw_scores(concatenated, query_length=queries.shape[1]).view(rows, n)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_packed_mask_by_hand():
    """[pad q | r1a r1b | r2a pad]: responses see the real query token and themselves, never each other."""
    query_mask = torch.tensor([[False, True]])
    response_mask = torch.tensor([[[True, True], [True, False]]])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # query padding: itself only
            [0, 1, 0, 0, 0, 0],  # query token
            [0, 1, 1, 0, 0, 0],  # r1a
            [0, 1, 1, 1, 0, 0],  # r1b
            [0, 1, 0, 0, 1, 0],  # r2a: not r1
            [0, 1, 0, 0, 1, 1],  # r2 padding: itself, never attended by others
        ],
        dtype=torch.bool,
    )
    mask = packed_best_of_n_mask(query_mask, response_mask)
    assert mask.shape == (1, 1, 6, 6)
    assert torch.equal(mask[0, 0], expected)


def test_last_pooling_reads_the_last_real_token(tiny_base_dir, pad):
    """Right padding after a response must not change its score."""
    rm = make_rm(tiny_base_dir, pad)
    queries, samples = batch(pad, rows=1, n=1)
    short = samples[:, :, :2]
    padded = torch.cat([short, torch.full((1, 1, 3), pad)], -1)
    torch.testing.assert_close(
        rm.score_best_of_n(queries, short), rm.score_best_of_n(queries, padded), atol=1e-5, rtol=1e-5
    )


def test_masked_mean_hidden_by_hand():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[1.0, 1.0], [7.0, 7.0], [9.0, 9.0]]])
    mask = torch.tensor([[True, False, True], [False, False, False]])
    torch.testing.assert_close(masked_mean_hidden(hidden, mask), torch.tensor([[3.0, 4.0], [0.0, 0.0]]))


def test_fit_normalization_hits_the_target(tiny_base_dir, pad):
    """gain = sigma_T / sigma_D, bias = mu_T - gain * mu_D (population std), applied to fresh scores."""
    rm = make_rm(tiny_base_dir, pad)
    raw = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, population std sqrt(3.5)
    gain, bias = fit_normalization(rm, raw, target_mean=0.0, target_std=1.0)
    assert gain == pytest.approx(1 / math.sqrt(3.5))
    assert bias == pytest.approx(-3 / math.sqrt(3.5))
    normalized = rm.normalize(raw)
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert normalized.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    queries, samples = batch(pad, n=1)
    raw_model = rm.score_best_of_n(queries, samples, normalized=False)[:, 0]
    torch.testing.assert_close(score_query_responses(rm, queries, samples[:, 0], batch_size=4), gain * raw_model + bias)


def test_constant_scores_cannot_be_normalised(tiny_base_dir, pad):
    from rlhf_pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match="std 0"):
        fit_normalization(make_rm(tiny_base_dir, pad), torch.ones(8), 0.0, 1.0)


def test_save_and_load_round_trip(tiny_base_dir, pad, tmp_path):
    rm = make_rm(tiny_base_dir, pad, "mean")
    fit_normalization(rm, torch.tensor([0.0, 1.0, 4.0]), 0.5, 2.0)
    save_reward_model(rm, tmp_path)
    loaded = load_reward_model(tmp_path)
    assert loaded.pooling == "mean"
    queries, samples = batch(pad)
    torch.testing.assert_close(loaded.score_best_of_n(queries, samples), rm.score_best_of_n(queries, samples))


def test_last_pooling_saves_a_stock_sequence_classifier_that_scores_like_the_project(tiny_base_dir, pad, tmp_path):
    """`AutoModelForSequenceClassification` loads models saved with last pooling; its logit is the
    normalised score (gain folded into score.weight) minus config.reward_offset, on unpadded and
    right-padded rows, and `load_reward_model` reads the same folder back."""
    from transformers import AutoModelForSequenceClassification

    rm = make_rm(tiny_base_dir, pad)
    with torch.no_grad():
        rm.head.bias.fill_(0.3)  # a non-zero head bias too: both constants go into the offset
    fit_normalization(rm, torch.tensor([0.0, 1.0, 4.0]), 0.5, 2.0)
    save_reward_model(rm, tmp_path)
    stock = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(stock).__name__ == "LlamaForSequenceClassification" and stock.config.num_labels == 1
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 250, (5, 9), generator=g)
    rows[1, 6:] = pad  # right padding: the stock class reads the last non-pad token, as the project does
    rows[3, 4:] = pad
    with torch.no_grad():
        ours = rm(rows)
        logits = stock(input_ids=rows, attention_mask=(rows != pad).long()).logits[:, 0]
    assert stock.config.reward_offset == pytest.approx(reward_offset(rm)) and abs(reward_offset(rm)) > 0.1
    torch.testing.assert_close(logits + stock.config.reward_offset, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(load_reward_model(tmp_path)(rows), ours)


def test_mean_pooling_cannot_be_loaded_as_a_stock_classifier(tiny_base_dir, pad, tmp_path):
    """No stock class pools a mean over the response: loading one must fail, not add a random head."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    rm = make_rm(tiny_base_dir, pad, "mean")
    save_reward_model(rm, tmp_path)
    for stock in (AutoModelForSequenceClassification, AutoModel):
        with pytest.raises(ValueError) as refusal:
            stock.from_pretrained(tmp_path)
        message = str(refusal.value)  # names the loader to use, before transformers' advice to upgrade
        loader = message.find("no transformers version loads it; use rlhf_pipeline.reward.persistence.load_reward")
        assert 0 <= loader < message.find("upgrade"), message
    with pytest.raises(ValueError, match="no stock Hugging Face class"):
        stock_classifier(rm)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_text_in_score_out_from_the_saved_folder(tiny_base_dir, pad, tmp_path, pooling):
    """load_reward_model(dir).score(queries, responses), the card's snippet: texts tokenized without
    special tokens, queries left-padded, responses right-padded, scores equal to the token-id scorer."""
    rm = make_rm(tiny_base_dir, pad, pooling)
    fit_normalization(rm, torch.tensor([0.0, 1.0, 4.0]), 0.5, 2.0)
    save_reward_model(rm, tmp_path)
    tokenizer = load_tokenizer(tiny_base_dir)
    tokenizer.save_pretrained(tmp_path)  # as the train_reward stage does
    loaded = load_reward_model(tmp_path)
    queries, responses = ["the film", "a long and winding query"], [" was fine.", " ok"]
    scores = loaded.score(queries, responses)
    assert isinstance(scores, list) and len(scores) == 2
    for query, response, score in zip(queries, responses, scores):
        q = torch.tensor([tokenizer(query, add_special_tokens=False)["input_ids"]])
        r = torch.tensor([[tokenizer(response, add_special_tokens=False)["input_ids"]]])
        assert score == pytest.approx(rm.score_best_of_n(q, r)[0, 0].item(), abs=1e-5)  # padding changes nothing
    with pytest.raises(PipelineError, match=r"needs a tokenizer: load the model with \S+\.load_reward_model"):
        rm.score(queries, responses)


def train_on_largest_first_token(rm, queries, samples, **overrides):
    """One epoch of ``train_reward_model`` on the learnable rule these tests use (prefer the sample
    whose first token id is largest), with their shared settings; ``overrides`` change them."""
    settings = {"lr": 1e-2, "epochs": 1, "batch_size": 8, "microbatch_size": 8, "adam_eps": 1e-5}
    # model_construct: the trainer's own guards are tested, so no schema check stops lr=inf before it
    cfg = RewardTrainParams.model_construct(**{**settings, **overrides})
    labels = Labels(queries, samples, samples[:, :, 0].argmax(-1))
    return train_reward_model(rm, labels, cfg, torch.Generator().manual_seed(0))


def test_training_anneals_the_lr_to_zero_and_learns(tiny_base_dir, pad):
    """One epoch of 4 steps over 32 labels: lr = lr0 * (1 - start/32) per step (OAI), the loss
    falls on a learnable rule (prefer the sample whose first token id is largest), and with
    the lowest block frozen only the top block and the head change."""
    rm = make_rm(tiny_base_dir, pad).train()
    trainable = freeze_lower_layers(rm.backbone, 1)
    assert 0 < trainable < sum(p.numel() for p in rm.parameters())
    frozen_before = rm.backbone.layers[0].mlp.down_proj.weight.detach().clone()
    top_before = rm.backbone.layers[1].mlp.down_proj.weight.detach().clone()
    queries, samples = batch(pad, rows=32, n=4, seed=1)
    best = samples[:, :, 0].argmax(-1)
    with torch.no_grad():
        initial_loss = best_of_n_loss(rm.score_best_of_n(queries, samples), best)[0].item()
    history = train_on_largest_first_token(rm, queries, samples, microbatch_size=4)
    assert [h["lr"] for h in history] == pytest.approx([1e-2, 0.75e-2, 0.5e-2, 0.25e-2])
    assert torch.equal(rm.backbone.layers[0].mlp.down_proj.weight, frozen_before)
    assert not torch.equal(rm.backbone.layers[1].mlp.down_proj.weight, top_before)
    with torch.no_grad():
        final_loss = best_of_n_loss(rm.score_best_of_n(queries, samples), best)[0].item()
    assert final_loss < initial_loss
    assert not rm.training  # back in eval mode
    accuracy = best_of_n_accuracy(rm, queries, samples, best, batch_size=16)
    assert 0.0 <= accuracy <= 1.0


def test_gain_gradient_by_hand():
    """d CE / d gain for raw rewards r = [1, 2], label 0, gain 1, bias 0:
    sum_i (p_i - y_i) r_i with p = softmax([1, 2]) = [0.268941, 0.731059] -> -0.731059 + 1.462117 = 0.731059;
    the bias gets no gradient (a softmax is shift-invariant)."""
    gain = torch.tensor(1.0, requires_grad=True)
    bias = torch.tensor(0.0, requires_grad=True)
    loss, _ = best_of_n_loss((gain * torch.tensor([[1.0, 2.0]]) + bias), torch.tensor([0]))
    loss.backward()
    assert gain.grad.item() == pytest.approx(0.731059, abs=1e-6)
    assert bias.grad.item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("train_gain_bias", [True, False])
def test_gain_and_bias_train_with_the_model_unless_switched_off(tiny_base_dir, pad, train_gain_bias):
    """Both references train the reward gain and bias with the model (reward.train.train_gain_bias)."""
    rm = make_rm(tiny_base_dir, pad).train()
    queries, samples = batch(pad, rows=8, n=4, seed=2)
    train_on_largest_first_token(rm, queries, samples, train_gain_bias=train_gain_bias)
    assert (rm.gain.item() != 1.0) is train_gain_bias
    assert rm.bias.item() == pytest.approx(0.0, abs=1e-4)  # zero gradient: Adam barely moves it


def test_tensorflow_adam_by_hand():
    """TF Adam (epsilon before bias correction) on one parameter, lr 0.1, betas (0.9, 0.999), eps 1e-3,
    starting at 1.0 with gradients 0.5 then -0.2:
      step 1: m = 0.05, v = 0.00025, sqrt(v) = 0.0158114, lr_t = 0.1 * sqrt(0.001) / 0.1 = 0.0316228,
              update = 0.0316228 * 0.05 / (0.0158114 + 0.001) = 0.0940518 -> 0.9059482
      step 2: m = 0.025, v = 0.00028975, sqrt(v) = 0.0170220, lr_t = 0.1 * sqrt(0.001999) / 0.19 = 0.0235317,
              update = 0.0235317 * 0.025 / (0.0170220 + 0.001) = 0.0326429 -> 0.8733053
    torch.optim.Adam (epsilon after bias correction) gives 0.9001996 and 0.8657296 instead."""
    from rlhf_pipeline.optim import adam

    for tensorflow, expected in ((True, [0.9059482, 0.8733053]), (False, [0.9001996, 0.8657296])):
        param = torch.nn.Parameter(torch.tensor([1.0]))
        optimizer = adam([param], lr=0.1, eps=1e-3, tensorflow=tensorflow)
        seen = []
        for grad in (0.5, -0.2):
            param.grad = torch.tensor([grad])
            optimizer.step()
            seen.append(param.item())
        assert seen == pytest.approx(expected, abs=2e-7), tensorflow
    # the state survives a save/load: a resumed optimizer keeps the TensorFlow epsilon
    restored = adam([torch.nn.Parameter(torch.tensor([1.0]))], lr=0.1, eps=1e-3)
    restored.load_state_dict(adam([param], lr=0.1, eps=1e-3).state_dict())
    assert restored.param_groups[0]["tensorflow_eps"] == 1e-3


def test_a_non_finite_loss_stops_with_exit_code_4(tiny_base_dir, pad):
    """An infinite learning rate makes the weights NaN after step 0, so step 1's loss is NaN: a
    NonFiniteError (exit 4, not retried by the flow), not a generic error that Prefect retries."""
    rm = make_rm(tiny_base_dir, pad).train()
    queries, samples = batch(pad, rows=16, n=4, seed=3)
    with pytest.raises(NonFiniteError, match="loss became non-finite at step 1; nothing was written") as info:
        train_on_largest_first_token(rm, queries, samples, lr=float("inf"))
    assert info.value.exit_code == 4


def test_a_non_finite_gradient_stops_before_the_step(tiny_base_dir, pad):
    """A finite loss with a NaN gradient (an fp16/bf16 overflow) stops before the optimizer step."""
    rm = make_rm(tiny_base_dir, pad).train()
    before = {name: p.detach().clone() for name, p in rm.named_parameters()}
    head = rm.head.weight
    head.register_hook(lambda grad: grad * float("nan"))
    queries, samples = batch(pad, rows=8, n=4, seed=3)
    with pytest.raises(NonFiniteError, match=r"gradient became non-finite at step 0 \(head.weight"):
        train_on_largest_first_token(rm, queries, samples)
    assert all(torch.equal(before[name], p) for name, p in rm.named_parameters())


def save_stock_reward_model(rm, tokenizer, directory, drop_rows: int = 0):
    """What a user brings: a one-label AutoModelForSequenceClassification folder with its tokenizer
    (``drop_rows``: its embeddings lack the pipeline's last added tokens, e.g. the dedicated pad)."""
    stock = stock_classifier(rm)
    if drop_rows:
        stock.resize_token_embeddings(stock.config.vocab_size - drop_rows)
        stock.config.pad_token_id = 0  # its own pad is one of the tokens it still has
    stock.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_an_existing_sequence_classifier_is_adopted_with_its_scores(
    tiny_base_dir, tiny_tokenizer, pad, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a local reward.pretrained lives in data/models/, which dvc.yaml tracks
    rm = make_rm(tiny_base_dir, pad, seed=3)
    fit_normalization(rm, torch.tensor([0.0, 1.0, 4.0]), 0.5, 2.0)
    source = save_stock_reward_model(rm, tiny_tokenizer, Path("data/models/external"), drop_rows=1)
    adopted = adopt_sequence_classifier(str(source), tiny_tokenizer).eval()
    assert adopted.pooling == "last" and adopted.backbone.get_input_embeddings().num_embeddings == len(tiny_tokenizer)
    queries, samples = batch(pad)  # left-padded queries, a right-padded sample: pads are never attended
    torch.testing.assert_close(adopted.score_best_of_n(queries, samples), rm.score_best_of_n(queries, samples))


def test_a_sequence_classifier_that_cannot_be_a_reward_model_is_refused(
    tiny_base_dir, tiny_tokenizer, pad, tmp_path, monkeypatch
):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    from rlhf_pipeline.errors import ParamsError, PipelineError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match=r"reward.pretrained \('missing/dir'\) could not be loaded"):
        adopt_sequence_classifier("missing/dir", tiny_tokenizer)
    # a folder DVC does not track for train_reward: changing it would not rerun the stage
    outside = save_stock_reward_model(make_rm(tiny_base_dir, pad), tiny_tokenizer, Path("elsewhere"))
    with pytest.raises(
        ParamsError, match="reward.pretrained: the local model folder elsewhere is outside data/models/"
    ):
        adopt_sequence_classifier(str(outside), tiny_tokenizer)
    source = save_stock_reward_model(make_rm(tiny_base_dir, pad), tiny_tokenizer, Path("data/models/two"))
    two = AutoModelForSequenceClassification.from_pretrained(source, num_labels=2, ignore_mismatched_sizes=True)
    two.save_pretrained(source)
    with pytest.raises(PipelineError, match="has 2 labels; a reward model has one"):
        adopt_sequence_classifier(str(source), tiny_tokenizer)
    bpe = ByteLevelBPETokenizer()  # the same byte alphabet, merges learned from other text: other ids
    bpe.train_from_iterator(["zebra quartz jumps"] * 20, vocab_size=300, special_tokens=["<|endoftext|>"])
    other = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<|endoftext|>")
    source = save_stock_reward_model(make_rm(tiny_base_dir, pad), other, Path("data/models/other"))
    with pytest.raises(PipelineError, match="uses a different tokenizer from the base model"):
        adopt_sequence_classifier(str(source), tiny_tokenizer)


@pytest.mark.e2e
def test_train_reward_stage_adopts_reward_pretrained_instead_of_training(project, tiny_base_dir, tiny_tokenizer, pad):
    from rlhf_pipeline.io import read_json
    from rlhf_pipeline.modelcard import read_card

    source = save_stock_reward_model(make_rm(tiny_base_dir, pad, seed=5), tiny_tokenizer, Path("data/models/ext_rm"))
    project.write_params(**{"reward.pretrained": str(source)})
    for stage in ("corpus", "queries", "preferences", "validate_preferences", "train_reward"):
        assert run_stage_script(stage) == 0, stage
    metrics = read_json(project / "metrics" / "reward_train.json")
    assert metrics["train/steps"] == 0 and metrics["trainable_parameters"] == 0 and "train/final_loss" not in metrics
    adopted = load_reward_model(project / "models" / "reward_unnormalized")
    external = adopt_sequence_classifier(str(source), tiny_tokenizer).eval()
    queries, samples = batch(pad)
    torch.testing.assert_close(adopted.score_best_of_n(queries, samples), external.score_best_of_n(queries, samples))
    card = read_card(project / "models" / "reward_unnormalized")
    assert card["pipeline_tag"] == "text-classification"
    assert "data/models/ext_rm" in (project / "models" / "reward_unnormalized" / "README.md").read_text()


@pytest.mark.e2e
def test_train_reward_without_the_contract_s_verdict_says_which_stage_writes_it(project, capsys):
    """data/validation/summary.json missing (validate_preferences never ran): exit 1 naming the file
    and the stage, not a traceback; nothing written."""
    assert run_stage_script("train_reward") == 1
    err = capsys.readouterr().err
    assert "data/validation/summary.json is missing" in err and "dvc repro validate_preferences" in err
    assert "Traceback" not in err
    assert not (project / "models/reward_unnormalized").exists()
