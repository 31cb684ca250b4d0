"""The offline default: a tiny Llama built from config, a character-level tokenizer and generated tasks.

Everything here is deterministic and needs no download, so the README command, the probe CLI and every
recipe run on a fresh CPU machine. The generated tasks are learnable (arithmetic, string transforms,
parity), and their responses differ a lot in length, so token-normalized accumulation matters on them.

    tok = build_tokenizer()
    model = build_model("causal_lm", tokenizer=tok)
    train = build_sft_dataset(512, tok, max_length=64, seed=0)
    Trainer(model, args, train_dataset=train, data_collator=SFTCollator(tok))
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from .window.loss import IGNORE_INDEX  # the label value transformers' loss functions skip

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"

# Turns are "Q: ...\n" then "A: ...</s>"; the generation prompt ends with "A: " so everything after it is target.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'A: ' + m['content'] + eos_token }}"
    "{% else %}{{ m['content'] + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)


# --- tokenizer ---------------------------------------------------------------------------------------
def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` over printable ASCII (+ 4 specials), built locally.

    Character level so that reversal, upper-casing and sorting are learnable by a 2-layer model and any
    generated text round-trips exactly through encode/decode.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))  # keeps "\n", "\t" and space
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    # BPE without merges splits any text into single characters; no pre-tokenizer keeps spaces as tokens.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


# --- model -------------------------------------------------------------------------------------------
def build_config(kind: str = "causal_lm", *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 tokenizer=None, num_labels: int = 2):
    """The tiny Llama's config (`build_model` builds from it; `hf-accum probe --estimate --model tiny` reads it)."""
    from transformers import LlamaConfig

    if kind not in _KINDS:
        raise ValueError(f"build_model(kind={kind!r}): kind must be one of {sorted(_KINDS)}")
    if hidden_size % num_heads:
        raise ValueError(f"build_model: hidden_size={hidden_size} must be a multiple of num_heads={num_heads}")
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=4096,  # RoPE computes positions on the fly, so a large limit costs nothing
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        num_labels=num_labels,
        tie_word_embeddings=False,  # LoRA recipes target/save lm_head separately from the embeddings
        architectures=[_KINDS[kind]],
    )


_KINDS = {"causal_lm": "LlamaForCausalLM", "seq_cls": "LlamaForSequenceClassification"}


def build_model(
    kind: str = "causal_lm",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    tokenizer=None,
    num_labels: int = 2,
):
    """A randomly initialised tiny Llama (`kind` "causal_lm" or "seq_cls"), seeded, vocab sized to `tokenizer`."""
    import transformers

    config = build_config(kind, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                          tokenizer=tokenizer, num_labels=num_labels)
    with torch.random.fork_rng(devices=[]):  # seeds the init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = getattr(transformers, _KINDS[kind])(config)
    if dtype is not None:
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model


# --- generated data ----------------------------------------------------------------------------------
# Ten letters, not 26: the per-character entropy a model must beat is lower, so the loss falls visibly
# within the few dozen steps a CI recipe run can afford, while copy tasks stay non-trivial.
LETTERS = "abcdefghij"


def _word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _add(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"add {a} and {b}", str(a + b)


def _reverse(rng):
    w = _word(rng, 3, 14)
    return f"reverse {w}", w[::-1]


def _upper(rng):
    w = _word(rng, 3, 14)
    return f"upper {w}", w.upper()


def _sort(rng):
    d = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 12)))
    return f"sort {d}", "".join(sorted(d))


def _repeat(rng):
    w, k = _word(rng, 1, 4), rng.randint(2, 6)
    return f"repeat {w} {k} times", " ".join([w] * k)


def _repeat_long_tailed(rng):
    # Pareto(1.2) counts: mostly 2-3 repeats, one in ten over 7, one in a hundred at the cap of 40
    w, k = _word(rng, 1, 4), min(1 + int(rng.paretovariate(1.2)), 40)
    return f"repeat {w} {k} times", " ".join([w] * k)


_TASKS = (_add, _reverse, _upper, _sort, _repeat)
# Real SFT data has a long tail of long responses: the same tasks, with repeat counts drawn from a heavy tail.
_LONG_TAILED_TASKS = (_add, _reverse, _upper, _sort, _repeat_long_tailed)


def generate_instruction_data(n: int, seed: int = 0, *, long_tailed: bool = False) -> list[dict[str, str]]:
    """`n` {"prompt", "response"} pairs; responses range from 1 character ("add 3 and 4") to ~30 ("repeat").
    ``long_tailed``: repeat counts from a heavy tail, so a few responses run to ~200 characters, like real SFT data
    (median short, mean pulled up by the tail)."""
    rng = random.Random(seed)
    tasks = _LONG_TAILED_TASKS if long_tailed else _TASKS
    rows = []
    for _ in range(n):
        prompt, response = rng.choice(tasks)(rng)
        rows.append({"prompt": prompt, "response": response})
    return rows


def generate_arithmetic_prompts(n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` {"prompt", "answer"} rows of the generated addition task ("add 37 and 45" -> "82"): prompts for GRPO, whose
    reward checks a completion against the answer (`hf_accum.recipes.rewards`)."""
    rng = random.Random(seed)
    return [dict(zip(("prompt", "answer"), _add(rng))) for _ in range(n)]


# Letters the instructions never use: a corrupted letter is one of these, so a model can learn to tell a rejected
# response from a chosen one without first solving the task (a digit is replaced by another digit).
_WRONG_LETTERS = "klmnopqrst"


def _corrupt(text: str, rng: random.Random) -> str:
    """``text`` with 1-3 characters replaced: a digit by another digit, a letter by one outside `LETTERS` (of the
    same case). A wrong answer of the same length, so a preference pair differs in content, not in length."""
    chars = list(text)
    positions = [i for i, c in enumerate(chars) if c.isalnum()] or list(range(len(chars)))
    for i in rng.sample(positions, min(len(positions), rng.randint(1, 3))):
        if chars[i].isdigit():
            chars[i] = rng.choice([c for c in string.digits if c != chars[i]])
        else:
            wrong = rng.choice(_WRONG_LETTERS)
            chars[i] = wrong.upper() if chars[i].isupper() else wrong
    return "".join(chars)


def generate_preference_data(n: int, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """`n` preference pairs in TRL's conversational format: the prompt as a user turn, chosen = the correct
    response, rejected = the same response with 1-3 characters corrupted."""
    rng = random.Random(seed)
    rows = []
    for row in generate_instruction_data(n, seed):
        rows.append({
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["response"]}],
            "rejected": [{"role": "assistant", "content": _corrupt(row["response"], rng)}],
        })
    return rows


def generate_classification_data(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` {"text", "label"} rows: label 1 when the number is even, else 0 (about balanced).

    The deciding digit comes before " even", so last-token pooling must learn to attend back to it.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        number = rng.randrange(10 ** rng.randint(1, 8))
        rows.append({"text": f"is {number} even", "label": int(number % 2 == 0)})
    return rows


# --- tokenization ------------------------------------------------------------------------------------
def chat_prompt_and_target(messages: list[dict[str, str]], tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of a chat rendered with the tokenizer's template, split before the last (assistant) turn.

    Rendered with and without the answer so the mask boundary is where the template puts it, whatever its
    role markers; a template that renders the prompt differently in the two cases cannot be split.
    """
    head = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(head):
        raise ValueError(
            "the chat template renders the conversation differently with and without the answer, so the prompt "
            "mask cannot be placed; use prompt/response text without the chat template instead"
        )
    prompt_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    return prompt_ids, tokenizer(full[len(head) :], add_special_tokens=False)["input_ids"]


def tokenize_sft(example: dict[str, str], tokenizer, max_length: int | None = None) -> dict[str, list[int]]:
    """input_ids / attention_mask / labels for one {"prompt", "response"} pair, prompt tokens labelled -100.

    Prompt and response are tokenized separately and concatenated so the mask boundary is exact for any
    tokenizer. With a chat template the text is the rendered conversation; without one it is
    bos + prompt + "\\n" + response + eos. Truncation cuts the end; an example whose response is cut away
    entirely has no target tokens (callers should drop it: see `build_sft_dataset`).
    """
    prompt, response = example["prompt"], example["response"]
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        prompt_ids, target_ids = chat_prompt_and_target(chat, tokenizer)
    else:
        prompt_ids = tokenizer(prompt + "\n", add_special_tokens=False)["input_ids"]
        if tokenizer.bos_token_id is not None:
            prompt_ids = [tokenizer.bos_token_id] + prompt_ids
        target_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + target_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + target_ids)[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def tokenize_classification(example: dict[str, Any], tokenizer, max_length: int | None = None) -> dict[str, Any]:
    ids = tokenizer(example["text"], add_special_tokens=False)["input_ids"][:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": int(example["label"])}


class ListDataset(Dataset):
    """A map-style dataset over a list of already-tokenized examples."""

    def __init__(self, rows: Sequence[dict[str, Any]]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def build_sft_dataset(n: int, tokenizer, max_length: int = 64, seed: int = 0) -> ListDataset:
    """`n` generated instruction pairs, tokenized; pairs left with no target token after truncation are dropped."""
    rows = [tokenize_sft(ex, tokenizer, max_length) for ex in generate_instruction_data(n, seed)]
    return ListDataset([r for r in rows if any(x != IGNORE_INDEX for x in r["labels"][1:])])


def build_classification_dataset(n: int, tokenizer, max_length: int = 64, seed: int = 0) -> ListDataset:
    return ListDataset(
        [tokenize_classification(ex, tokenizer, max_length) for ex in generate_classification_data(n, seed)]
    )


# --- collators ---------------------------------------------------------------------------------------
def _pad(seqs: Sequence[Sequence[int]], value: int, multiple: int | None) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    if multiple:
        width = -(-width // multiple) * multiple
    return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


class SFTCollator:
    """Right-pads input_ids (pad id), attention_mask (0) and labels (-100) to the longest example.

    Always right: Llama derives positions from the sequence index, so left padding would shift every
    position during training. Padding never adds target tokens, so token counts are those of the data.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def _inputs(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [f["input_ids"] for f in features]
        masks = [f.get("attention_mask", [1] * len(f["input_ids"])) for f in features]
        return {
            "input_ids": _pad(ids, self.pad_token_id, self.pad_to_multiple_of),
            "attention_mask": _pad(masks, 0, self.pad_to_multiple_of),
        }

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        labels = _pad([f["labels"] for f in features], IGNORE_INDEX, self.pad_to_multiple_of)
        return {**self._inputs(features), "labels": labels}


class ClassificationCollator(SFTCollator):
    """Like `SFTCollator`, with one integer label per example instead of a label sequence."""

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        labels = torch.tensor([int(f["labels"]) for f in features], dtype=torch.long)
        return {**self._inputs(features), "labels": labels}
