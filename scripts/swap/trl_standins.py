"""Local stand-ins for the hub models and datasets TRL's own tests load, for `trl_swap_suite.py` (no hub access).

A stand-in model has the architecture the test expects (e.g. `Qwen3MoeForCausalLM` for
"trl-internal-testing/tiny-Qwen3MoeForCausalLM"), tiny dimensions, bf16 weights like the hub's tiny models, and a
character-level tokenizer (`hf_accum.tiny.build_tokenizer`'s scheme) with the family's special tokens as single
tokens and the family's real chat template, read from the installed TRL's `trl/chat_templates/` (TRL recognizes a
template by exact text, e.g. to swap in its `{% generation %}` training template). `populate_cache` writes them as a
Hugging Face hub cache (`models--org--name/snapshots/<rev>/`), so `from_pretrained("trl-internal-testing/...")`
resolves them with HF_HUB_OFFLINE=1, wherever TRL or a test calls it.

A stand-in dataset has the columns of the hub dataset's config (TRL's dataset formats: "standard_preference" has
prompt / chosen / rejected, ...), generated from the Zen of Python (Python's own `this` module, as the hub's "zen"),
split 17 train / 2 test. `load_dataset` is the replacement the swap conftest installs for `datasets.load_dataset`.

An id with no stand-in (vision models, "stanfordnlp/imdb", ...) is not built: `missing_ids(text)` names the ids an
error message mentions that have none, so the conftest can report such a test as skipped instead of failed.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ORG = "trl-internal-testing"
REVISION = "0" * 40  # the snapshot "commit" every stand-in lives under


@dataclass(frozen=True)
class Family:
    """A tokenizer family: its special tokens, which of them are bos / eos / pad, and its chat template file."""

    template: str | None  # file name in trl/chat_templates/ without ".jinja"; None: no chat template
    specials: tuple[str, ...]
    eos: str
    pad: str | None = None
    bos: str | None = None
    add_bos: bool = False  # the tokenizer prepends bos (Llama 3's post-processor does)
    extra: tuple[str, ...] = ()  # added tokens that are not special (e.g. Qwen's <think>)


QWEN2_5 = Family("qwen2_5", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", pad="<|endoftext|>",
                 extra=("<tool_call>", "</tool_call>"))
QWEN3 = Family("qwen3", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", pad="<|endoftext|>",
               extra=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"))
LLAMA3 = Family("llama3_2", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>", "<|finetune_right_pad_id|>"), eos="<|eot_id|>",
                bos="<|begin_of_text|>", add_bos=True)
GPTOSS = Family("gptoss", ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                           "<|call|>", "<|constrain|>"), eos="<|return|>", pad="<|endoftext|>")
NEOX = Family(None, ("<|endoftext|>",), eos="<|endoftext|>", bos="<|endoftext|>")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # transformers class name
    config: str  # transformers config class name
    family: Family
    config_kwargs: dict = field(default_factory=dict)


_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
MODELS: dict[str, ModelSpec] = {
    f"{ORG}/tiny-Qwen2ForCausalLM-2.5": ModelSpec("Qwen2ForCausalLM", "Qwen2Config", QWEN2_5),
    f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5": ModelSpec("Qwen2ForSequenceClassification", "Qwen2Config",
                                                                 QWEN2_5, {"num_labels": 1}),
    f"{ORG}/tiny-Qwen3ForCausalLM": ModelSpec("Qwen3ForCausalLM", "Qwen3Config", QWEN3),
    f"{ORG}/tiny-Qwen3MoeForCausalLM": ModelSpec("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3, _MOE),
    f"{ORG}/tiny-GptOssForCausalLM": ModelSpec("GptOssForCausalLM", "GptOssConfig", GPTOSS,
                                               {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 4,
                                                "layer_types": ["sliding_attention", "full_attention"]}),
    f"{ORG}/tiny-LlamaForCausalLM-3.2": ModelSpec("LlamaForCausalLM", "LlamaConfig", LLAMA3),
    f"{ORG}/tiny-GPTNeoXForCausalLM": ModelSpec("GPTNeoXForCausalLM", "GPTNeoXConfig", NEOX),
}

DIMS = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048}


# --- which ids have stand-ins ------------------------------------------------------------------------
# Hub ids as TRL's tests spell them: an organisation TRL's tests load from, a slash, a repository name.
_HUB_ID = re.compile(r"\b(?:trl-internal-testing|stanfordnlp|google|Qwen|kernels-community|meta-llama)/[\w.-]*\w")


def has_standin(hub_id: str) -> bool:
    return hub_id in MODELS or hub_id in DATASETS


def missing_ids(text: str) -> list[str]:
    """The hub ids `text` (e.g. an error message) names that have no stand-in, in order, without repeats."""
    found = []
    for hub_id in _HUB_ID.findall(text):
        if not has_standin(hub_id) and hub_id not in found:
            found.append(hub_id)
    return found


def cache_dir_name(hub_id: str, kind: str = "model") -> str:
    """The hub cache's folder for a repository: "models--org--name"."""
    return f"{kind}s--" + hub_id.replace("/", "--")


# --- datasets -----------------------------------------------------------------------------------------
def zen_lines() -> list[str]:
    """The 19 aphorisms of the Zen of Python, from Python's `this` module (rot13 there; decoded, not printed)."""
    import importlib.util

    spec = importlib.util.find_spec("this")
    source = Path(spec.origin).read_text()
    encoded = re.search(r's = """(.*?)"""', source, re.S).group(1)
    text = codecs.decode(encoded, "rot13")
    return [line for line in text.splitlines()[1:] if line.strip()]


def _halves(line: str) -> tuple[str, str]:
    """A line cut before its middle word: ("Beautiful is", " better than ugly.")."""
    words = line.split(" ")
    cut = max(1, len(words) // 2)
    return " ".join(words[:cut]), " " + " ".join(words[cut:])


def zen_columns(config: str) -> dict[str, list]:
    """The columns of one "zen" config (TRL's dataset formats), 19 rows; rejected = the next line's ending."""
    lines = zen_lines()
    prompts, completions = zip(*(_halves(line) for line in lines))
    rejected = completions[1:] + completions[:1]
    n = len(lines)

    def user(text):
        return [{"role": "user", "content": text}]

    def assistant(text):
        return [{"role": "assistant", "content": text.strip()}]

    labels = [i % 2 == 0 for i in range(n)]
    columns = {
        "standard_language_modeling": {"text": list(lines)},
        "standard_prompt_only": {"prompt": list(prompts)},
        "standard_prompt_completion": {"prompt": list(prompts), "completion": list(completions)},
        "standard_preference": {"prompt": list(prompts), "chosen": list(completions), "rejected": list(rejected)},
        "standard_implicit_prompt_preference": {"chosen": list(lines),
                                                "rejected": [p + r for p, r in zip(prompts, rejected)]},
        "standard_unpaired_preference": {"prompt": list(prompts),
                                         "completion": [c if ok else r for c, r, ok in
                                                        zip(completions, rejected, labels)], "label": labels},
        "conversational_language_modeling": {"messages": [user(p) + assistant(c) for p, c in zip(prompts,
                                                                                                   completions)]},
        "conversational_prompt_only": {"prompt": [user(p) for p in prompts]},
        "conversational_prompt_completion": {"prompt": [user(p) for p in prompts],
                                             "completion": [assistant(c) for c in completions]},
        "conversational_preference": {"prompt": [user(p) for p in prompts],
                                      "chosen": [assistant(c) for c in completions],
                                      "rejected": [assistant(r) for r in rejected]},
        "conversational_implicit_prompt_preference": {
            "chosen": [user(p) + assistant(c) for p, c in zip(prompts, completions)],
            "rejected": [user(p) + assistant(r) for p, r in zip(prompts, rejected)]},
        "conversational_unpaired_preference": {"prompt": [user(p) for p in prompts],
                                               "completion": [assistant(c if ok else r) for c, r, ok in
                                                              zip(completions, rejected, labels)],
                                               "label": labels},
    }
    if config not in columns:
        raise KeyError(f"zen has no stand-in for config {config!r}; known: {sorted(columns)}")
    return columns[config]


DATASETS = {f"{ORG}/zen": zen_columns}


def load_dataset(path, name=None, *, split=None, streaming=False, **_):
    """`datasets.load_dataset` for the stand-in datasets: a DatasetDict (train 17 / test 2), or one split."""
    from datasets import Dataset

    if path not in DATASETS:
        raise FileNotFoundError(f"no local stand-in for dataset {path} (trl_standins.DATASETS)")
    splits = Dataset.from_dict(DATASETS[path](name)).train_test_split(test_size=0.1, shuffle=False)
    if streaming:
        from datasets import IterableDatasetDict

        splits = IterableDatasetDict({k: v.to_iterable_dataset() for k, v in splits.items()})
    return splits if split is None else splits[split]


# --- models -------------------------------------------------------------------------------------------
def chat_template(family: Family) -> str | None:
    if family.template is None:
        return None
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{family.template}.jinja").read_text()


def build_tokenizer(family: Family):
    """Character-level fast tokenizer (printable ASCII) with the family's special tokens as single tokens."""
    import string

    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(list(family.specials) + list(family.extra) + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.extra])
    if family.add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, vocab[family.bos])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=family.eos, pad_token=family.pad,
                                   bos_token=family.bos, padding_side="right", clean_up_tokenization_spaces=False,
                                   chat_template=chat_template(family), model_max_length=2048)


def build_model(spec: ModelSpec, tokenizer):
    import torch
    import transformers

    kwargs = dict(DIMS, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, **spec.config_kwargs)
    config = getattr(transformers, spec.config)(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, spec.architecture)(config)
    return model.to(torch.bfloat16)  # the hub's tiny models are bf16


def populate_cache(cache: Path, ids=None) -> list[str]:
    """Write every stand-in model (or those in `ids`) into `cache` as a hub cache; returns the ids written.
    A model already there is kept (same code, same seed: same weights)."""
    written = []
    for hub_id in ids or MODELS:
        spec = MODELS[hub_id]
        repo = cache / cache_dir_name(hub_id)
        snapshot = repo / "snapshots" / REVISION
        if not (snapshot / "config.json").exists():
            tokenizer = build_tokenizer(spec.family)
            build_model(spec, tokenizer).save_pretrained(snapshot)
            tokenizer.save_pretrained(snapshot)
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(REVISION)
            (snapshot / "STANDIN.json").write_text(json.dumps({"id": hub_id, "architecture": spec.architecture}))
        written.append(hub_id)
    return written
