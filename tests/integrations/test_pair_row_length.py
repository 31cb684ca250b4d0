"""The probe measures a preference trainer at its widest collated row. A DPO pair is collated into rows of prompt +
completion (chosen and rejected padded to one width), so it is wider than any one of its columns: the probe picks the
example whose collated row is widest, checked here against TRL's own collator run on every example alone, on pairs
whose longest prompt and longest completion are in different examples."""

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference as DPOCollator  # noqa: E402
from trl.trainer.reward_trainer import DataCollatorForPreference as RewardCollator  # noqa: E402

from hf_accum import tiny  # noqa: E402
from hf_accum.integrations.trl.support import dpo_row_length, reward_row_length  # noqa: E402
from hf_accum.planning.data_scan import probe_batches, train_lengths  # noqa: E402
from hf_accum.trl import AccumDPOConfig, AccumDPOTrainer, AccumRewardConfig, AccumRewardTrainer  # noqa: E402

# (prompt, chosen, rejected) lengths in characters (the tiny tokenizer is character-level): the longest prompt (30)
# is in the first pair, the longest completion (28) in the second, the widest pair (20 + 25) in the third
SHAPES = [(30, 4, 2), (5, 28, 10), (20, 20, 25), (8, 6, 7), (12, 3, 9)]


def pairs() -> Dataset:
    return Dataset.from_list([{"prompt": "p" * p, "chosen": "c" * c, "rejected": "r" * r} for p, c, r in SHAPES])


def dpo_trainer(tmp_path, **kw):
    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, hidden_size=32)
    args = AccumDPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=1,
                          auto_tune=False, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                          precompute_ref_log_probs=True, **kw)
    return AccumDPOTrainer(model=model, args=args, train_dataset=pairs(), processing_class=tok)


def widest_collated(dataset, collate) -> int:
    """The width of the widest batch TRL's collator builds from any one example (the independent reference)."""
    return max(collate([dataset[i]])["input_ids"].shape[1] for i in range(len(dataset)))


@pytest.mark.parametrize("kw", [{"max_length": None}, {"max_length": 40},
                                {"max_length": 40, "truncation_mode": "keep_end"}],
                         ids=["uncut", "keep_start", "keep_end"])
def test_the_dpo_probe_measures_the_widest_collated_pair(tmp_path, kw):
    trainer = dpo_trainer(tmp_path, **kw)
    data = trainer.get_train_dataloader().dataset
    collate = DPOCollator(pad_token_id=trainer.processing_class.pad_token_id, max_length=kw["max_length"],
                          truncation_mode=kw.get("truncation_mode", "keep_start"))
    want = widest_collated(data, collate)
    columns = max(max(len(data[i][k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")) for i in range(len(data)))
    assert want > columns if kw["max_length"] is None else want == 40  # the case a column's length gets wrong
    make_batch, seq = probe_batches(trainer)
    assert seq == want
    batch = make_batch(3)
    assert batch["input_ids"].shape == (6, want)  # 3 pairs: 3 chosen + 3 rejected rows, each as wide as the pair
    widths = [collate([data[i]])["input_ids"].shape[1] for i in range(len(data))]
    assert train_lengths(trainer) == widths  # the token budget's lengths are the collated widths too


def test_reward_probe_measures_the_widest_collated_pair(tmp_path):
    tok = tiny.build_tokenizer()
    model = tiny.build_model("seq_cls", tokenizer=tok, hidden_size=32, num_labels=1)
    args = AccumRewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=1,
                             auto_tune=False, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False)
    trainer = AccumRewardTrainer(model=model, args=args, train_dataset=pairs(), processing_class=tok)
    data = trainer.get_train_dataloader().dataset
    collate = RewardCollator(pad_token_id=tok.pad_token_id)
    want = widest_collated(data, collate)
    make_batch, seq = probe_batches(trainer)
    assert seq == want
    assert make_batch(2)["input_ids"].shape == (4, want)
    assert train_lengths(trainer) == [collate([data[i]])["input_ids"].shape[1] for i in range(len(data))]


def test_row_lengths_are_those_of_the_collators():
    ex = {"prompt_ids": [1] * 7, "chosen_ids": [2] * 3, "rejected_ids": [3] * 5}
    assert dpo_row_length(ex, None) == 12 and dpo_row_length(ex, 10) == 10 and dpo_row_length(ex, 64) == 12
    assert dpo_row_length({"prompt": "x", "chosen": "y", "rejected": "z"}, 8) is None  # a vision row, untokenized
    assert reward_row_length({"chosen_ids": [1] * 4, "rejected_ids": [2] * 6, "margin": 0.5}) == 6
    assert reward_row_length({"input_ids": [1, 2]}) is None
    for collate, ex_ in ((DPOCollator(pad_token_id=0), ex), (DPOCollator(pad_token_id=0, max_length=10), ex),
                         (RewardCollator(pad_token_id=0), {"chosen_ids": [1] * 4, "rejected_ids": [2] * 6})):
        width = collate([ex_])["input_ids"].shape[1]
        got = reward_row_length(ex_) if isinstance(collate, RewardCollator) else dpo_row_length(ex_, collate.max_length)
        assert got == width
    assert torch.equal(DPOCollator(pad_token_id=0)([ex])["attention_mask"].sum(1), torch.tensor([10, 12]))
