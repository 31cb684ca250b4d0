"""scripts/swap/examples_swap.py's pure parts (the harness itself runs transformers' example scripts, which are
fetched separately, so it is not run here): the two-name substitution applies once or names what changed, and the
offline stand-ins for the hub's ROUGE / BLEU compute what they say, checked by hand."""

import importlib
import importlib.util

import pytest

from tests.swap_scripts import load

swap = load("examples_swap")

SCRIPT = """from transformers import (
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)
from transformers.utils import check_min_version

parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
# Override the decoding parameters of Seq2SeqTrainer
trainer = Seq2SeqTrainer(args=parser)
"""


def test_two_names_are_swapped_and_the_comment_is_left():
    out = swap.swapped_source(SCRIPT)
    assert "from transformers import (\n    HfArgumentParser,\n    set_seed,\n)" in out
    assert "from hf_accum import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments\n" in out
    assert "(ModelArguments, DataTrainingArguments, AccumSeq2SeqTrainingArguments))" in out
    assert "trainer = AccumSeq2SeqTrainer(" in out and "# Override the decoding parameters of Seq2SeqTrainer" in out
    compile(out, "swapped", "exec")


def test_a_changed_script_is_named_not_swapped_silently():
    with pytest.raises(SystemExit, match=r"'trainer = Seq2SeqTrainer\(' occurs 2 times in the script"):
        swap.swapped_source(SCRIPT + "trainer = Seq2SeqTrainer(args=None)\n")


@pytest.fixture(scope="module")
def evaluate_shim(tmp_path_factory):
    path = tmp_path_factory.mktemp("shim") / "evaluate_shim.py"
    path.write_text(swap.EVALUATE_SHIM)
    spec = importlib.util.spec_from_file_location("evaluate_shim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rouge_stand_in_by_hand(evaluate_shim):
    rouge = evaluate_shim.load("rouge")
    # "the cat sat" vs "The cat sat down!": unigrams 3 of 3 and 3 of 4: F1 = 2*1*.75/1.75; bigrams 2/2, 2/3;
    # LCS 3: as unigrams. The second pair shares nothing.
    got = rouge.compute(predictions=["the cat sat", "a b"], references=["The cat sat down!", "c d"])
    assert got["rouge1"] == pytest.approx((2 * 0.75 / 1.75) / 2)
    assert got["rouge2"] == pytest.approx((2 * (2 / 3) / (1 + 2 / 3)) / 2)
    assert got["rougeL"] == pytest.approx(got["rouge1"])


def test_bleu_stand_in_by_hand(evaluate_shim):
    bleu = evaluate_shim.load("sacrebleu")
    same = "one two three four five"
    assert bleu.compute(predictions=[same], references=[[same]])["score"] == pytest.approx(100)
    assert bleu.compute(predictions=["x y z w"], references=[["a b c d"]])["score"] == 0
    # 4-gram precisions 5/5, 4/4, 3/3, 2/2 and a reference of 6 words: only the brevity penalty exp(1 - 6/5)
    got = bleu.compute(predictions=[same], references=[[same + " six"]])["score"]
    assert got == pytest.approx(100 * 2.718281828459045 ** (1 - 6 / 5))
    with pytest.raises(ValueError, match="no metric 'bertscore'"):
        evaluate_shim.load("bertscore")
