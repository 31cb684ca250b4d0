"""The offline default: tokenizer, tiny Llama, generated data, SFT masking/collation, and that it learns."""

import statistics

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments

from hf_accum import tiny


def _targets(row):
    # Causal-LM losses shift labels by one, so position 0 is never a target.
    return sum(x != tiny.IGNORE_INDEX for x in row["labels"][1:])


def test_tokenizer_is_real_and_configured(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<s>", "</s>", "<unk>")
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert tok.padding_side == "right"
    assert tiny.build_tokenizer().get_vocab() == tok.get_vocab()
    chat = [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<s>Q: add 1 and 2\nA: 3</s>"
    ids = tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<s>Q: add 1 and 2\nA: "


def test_tokenizer_round_trips_generated_text(tok):
    texts = [t for ex in tiny.generate_instruction_data(200, seed=1) for t in ex.values()]
    texts += [ex["text"] for ex in tiny.generate_classification_data(50, seed=1)]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    row = tiny.tokenize_sft({"prompt": "upper abc", "response": "ABC"}, tok)
    assert tok.decode(row["input_ids"]) == "<s>Q: upper abc\nA: ABC</s>"


def test_labels_mask_the_prompt(tok):
    for ex in tiny.generate_instruction_data(50, seed=2):
        row = tiny.tokenize_sft(ex, tok, max_length=128)
        user = [{"role": "user", "content": ex["prompt"]}]
        n_prompt = len(tok.apply_chat_template(user, add_generation_prompt=True, return_dict=False))
        assert row["labels"][:n_prompt] == [tiny.IGNORE_INDEX] * n_prompt
        first = row["labels"][n_prompt]
        assert first == row["input_ids"][n_prompt] == tok(ex["response"], add_special_tokens=False)["input_ids"][0]
        assert tok.decode(row["labels"][n_prompt:]) == ex["response"] + tok.eos_token
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["attention_mask"])


def test_fallback_without_chat_template(tok):
    plain = tiny.build_tokenizer()
    plain.chat_template = None
    row = tiny.tokenize_sft({"prompt": "sort 31", "response": "13"}, plain)
    assert plain.decode(row["input_ids"]) == "<s>sort 31\n13</s>"
    assert plain.decode([x for x in row["labels"] if x != tiny.IGNORE_INDEX]) == "13</s>"


def test_target_counts_vary_a_lot(tok):
    ds = tiny.build_sft_dataset(200, tok, max_length=64, seed=0)
    counts = [_targets(ds[i]) for i in range(len(ds))]
    assert len(ds) == 200
    assert min(counts) <= 3 and max(counts) >= 20
    assert len(set(counts)) >= 15


def test_truncation_drops_examples_without_targets(tok):
    ds = tiny.build_sft_dataset(100, tok, max_length=28, seed=0)
    assert 0 < len(ds) < 100
    assert all(len(ds[i]["input_ids"]) <= 28 and _targets(ds[i]) > 0 for i in range(len(ds)))


def test_data_is_deterministic_per_seed():
    assert tiny.generate_instruction_data(30, seed=3) == tiny.generate_instruction_data(30, seed=3)
    assert tiny.generate_instruction_data(30, seed=3) != tiny.generate_instruction_data(30, seed=4)
    assert tiny.generate_classification_data(30, seed=3) == tiny.generate_classification_data(30, seed=3)
    assert tiny.generate_classification_data(30, seed=3) != tiny.generate_classification_data(30, seed=4)
    labels = [ex["label"] for ex in tiny.generate_classification_data(400, seed=0)]
    assert 0.4 < sum(labels) / len(labels) < 0.6
    # Responses are right, so the tasks are learnable rather than noise.
    for ex in tiny.generate_instruction_data(100, seed=5):
        verb, *args = ex["prompt"].split()
        if verb == "add":
            assert int(ex["response"]) == int(args[0]) + int(args[2])
        elif verb == "reverse":
            assert ex["response"] == args[0][::-1]


def test_build_model_is_seeded_and_matches_tokenizer(tok):
    rng_before = torch.random.get_rng_state()
    a = tiny.build_model("causal_lm", tokenizer=tok, seed=0)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    b = tiny.build_model("causal_lm", tokenizer=tok, seed=0)
    c = tiny.build_model("causal_lm", tokenizer=tok, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.vocab_size == len(tok) and a.config.pad_token_id == tok.pad_token_id
    assert tiny.build_model(tokenizer=tok, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kind must be one of"):
        tiny.build_model("seq2seq", tokenizer=tok)


def test_sft_collator_right_pads(tok):
    ds = tiny.build_sft_dataset(8, tok, max_length=64, seed=0)
    rows = [ds[i] for i in range(len(ds))]
    batch = tiny.SFTCollator(tok, pad_to_multiple_of=8)(rows)
    longest = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[1] >= longest
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == r["input_ids"]
        assert (batch["input_ids"][i, n:] == tok.pad_token_id).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        assert (batch["labels"][i, n:] == tiny.IGNORE_INDEX).all()
    assert (batch["labels"][:, 1:] != tiny.IGNORE_INDEX).sum().item() == sum(_targets(r) for r in rows)
    loss = tiny.build_model(tokenizer=tok)(**batch).loss
    assert torch.isfinite(loss)


def test_classification_data_and_collator(tok):
    ds = tiny.build_classification_dataset(16, tok, max_length=32, seed=0)
    batch = tiny.ClassificationCollator(tok)([ds[i] for i in range(16)])
    assert batch["labels"].shape == (16,) and batch["labels"].dtype == torch.long
    model = tiny.build_model("seq_cls", tokenizer=tok, num_labels=2)
    out = model(**batch)
    assert out.logits.shape == (16, 2) and torch.isfinite(out.loss)


def test_plain_trainer_learns_sft_data(tok, tmp_path):
    model = tiny.build_model("causal_lm", tokenizer=tok, seed=0)
    train = tiny.build_sft_dataset(640, tok, max_length=64, seed=0)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=40,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=tiny.SFTCollator(tok))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    print(f"tiny SFT, 40 steps: first-5 mean loss {first:.3f}, last-5 mean loss {last:.3f}, ratio {last / first:.3f}")
    assert len(losses) == 40
    assert last < 0.7 * first
