"""Recipes on a user's own model and data (issue 54): config-built folders of real architectures (Qwen2- and
Llama-shaped, their real vocabulary sizes, a few tiny layers) and a user JSONL of 5,000 rows. The resolved settings
hold no value of the tiny profile, every row is used, a few steps train on CPU; the offline default keeps its
values; `--print-config` and the run's `recipe.yaml` say where each value came from."""

import json

import pytest
import torch

from hf_accum import recipes, tiny
from hf_accum.cli import main
from hf_accum.recipes import load_recipe, read_yaml, recipe_path
from hf_accum.recipes.profile import PROFILE, toy_warning

# One xdist worker runs these tests (--dist loadgroup): `models` and `data` are built once, not on each.
pytestmark = pytest.mark.xdist_group("test_recipe_real")

NAMES = ["lora_sft", "qlora_sft", "lora_dpo", "lora_grpo", "lora_classification"]
ROWS = 5000


def _tokenizer(vocab_size: int):
    """The tiny character-level tokenizer (chat template, eos, pad) grown to a real model's vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    small = tiny.build_tokenizer()
    vocab = dict(small.backend_tokenizer.get_vocab())
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=tiny.UNK))
    backend.decoder = decoders.Fuse()
    specials = [tiny.PAD, tiny.BOS, tiny.EOS, tiny.UNK]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=tiny.PAD, bos_token=tiny.BOS,
                                   eos_token=tiny.EOS, unk_token=tiny.UNK, chat_template=tiny.CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def _folder(root, name: str, config):
    tok = _tokenizer(config.vocab_size)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
    tok.save_pretrained(root / name)
    return str(root / name)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaConfig, Qwen2Config

    root = tmp_path_factory.mktemp("models")
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 4096}
    return {"qwen2": _folder(root, "qwen2", Qwen2Config(vocab_size=151936, **small)),
            "llama": _folder(root, "llama", LlamaConfig(vocab_size=128256, **small))}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A user's JSONL of 5,000 rows for each kind of recipe."""
    root = tmp_path_factory.mktemp("data")
    rows = {
        "sft": tiny.generate_instruction_data(ROWS, seed=5),
        "dpo": tiny.generate_preference_data(ROWS, seed=5),
        "grpo": tiny.generate_arithmetic_prompts(ROWS, seed=5),
        "cls": tiny.generate_classification_data(ROWS, seed=5),
    }
    out = {}
    for kind, items in rows.items():
        out[kind] = str(root / f"{kind}.jsonl")
        with open(out[kind], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in items)
    return out


# Speed only, none of them a tiny-profile value: a 150k vocabulary's logits make 16 rows a step take ~25 s on 2 CPUs.
FAST = ["target_batch_size=4", "model.cpu_threads=1", "disable_tqdm=true"]
DATA_OF = {"lora_sft": "sft", "qlora_sft": "sft", "lora_dpo": "dpo", "lora_grpo": "grpo", "lora_classification": "cls"}


def _profile(name: str) -> dict:
    return read_yaml(recipe_path(name))[PROFILE]


@pytest.mark.parametrize("name", NAMES)
def test_a_users_model_gets_none_of_the_tiny_profile(name, models, data):
    recipe = load_recipe(name, [f"model={models['qwen2']}", f"dataset={data[DATA_OF[name]]}"])
    resolved = recipe.to_dict()
    assert "profile" not in recipe.sources.values()
    base = read_yaml(recipe_path(name))
    for section, values in _profile(name).items():
        for key in values:
            assert recipe.sources.get(f"{section}.{key}") != "profile", (section, key)
            if key in base.get(section, {}):  # the recipe's own value, not the profile's
                assert resolved[section][key] == base[section][key], (section, key)
    assert recipe.model.cpu_threads is None and recipe.model.tiny == {} and "max_steps" not in recipe.training
    args = recipe.validate()
    assert args.memory_budget_bytes is None and args.memory_budget == 0.9 and args.max_steps == -1
    assert recipe.sources["training.memory_budget"] == "machine" and args.num_train_epochs == 1
    assert recipe.data.num_examples is None  # every row
    assert recipe.lora["target_modules"] == "all-linear" and not recipe.lora.get("modules_to_save")
    expected_lr = {"lora_dpo": 5e-6, "lora_grpo": 1e-5}.get(name, 2e-4)
    assert args.learning_rate == expected_lr
    gpu = torch.cuda.is_available()
    assert args.use_cpu is not gpu and recipe.sources["training.use_cpu"] == "machine"
    if not gpu:
        assert not args.bf16 and recipe.sources["training.bf16"] == "machine"


def test_on_a_gpu_the_machine_values_are_bf16_on_cuda(models):
    recipe = load_recipe("lora_sft", [f"model={models['qwen2']}"], device="cuda")
    assert recipe.training["bf16"] is True and recipe.training["use_cpu"] is False
    assert recipe.model.dtype == "bfloat16" and recipe.sources["model.dtype"] == "machine"
    tiny_run = load_recipe("lora_sft", device="cuda")  # the demonstration stays float32 on the CPU
    assert tiny_run.training["bf16"] is False and tiny_run.training["use_cpu"] is True and tiny_run.model.dtype is None


OLD_TINY = {  # the offline default before the profile: unchanged
    "lora_sft": {"memory_budget_bytes": 83886080, "learning_rate": 1e-2, "max_steps": 60, "max_length": 128},
    "qlora_sft": {"memory_budget_bytes": 41943040, "learning_rate": 1e-2, "max_steps": 60, "max_length": 128},
    "lora_dpo": {"memory_budget_bytes": 67108864, "learning_rate": 1e-2, "max_steps": 60, "max_length": 64,
                 "beta": 0.5},
    "lora_grpo": {"memory_budget_bytes": 20971520, "learning_rate": 5e-3, "max_steps": 40,
                  "max_completion_length": 4, "gradient_checkpointing": False},
    "lora_classification": {"memory_budget_bytes": 2097152, "learning_rate": 5e-3, "max_steps": 60},
}


@pytest.mark.parametrize("name", NAMES)
def test_the_offline_default_keeps_its_values(name):
    recipe = load_recipe(name)
    for key, value in {**OLD_TINY[name], "use_cpu": True, "bf16": False}.items():
        assert recipe.training[key] == value, key
        assert recipe.sources[f"training.{key}"] == "profile", key
    assert recipe.model.cpu_threads == 1 and recipe.model.tiny["hidden_size"] == 64
    assert "embed_tokens" in recipe.lora["target_modules"] and recipe.data.num_examples is None  # 2000 generated
    assert load_recipe(name, ["learning_rate=3e-3"]).sources["training.learning_rate"] == "override"


def test_print_config_names_each_source_and_the_run_writes_it(models, data, tmp_path, capsys):
    out = tmp_path / "out"
    overrides = [f"model={models['qwen2']}", f"dataset={data['sft']}", "max_steps=2", *FAST,
                 "disable_tqdm=true", f"output_dir={out}"]
    assert main(["train", "lora_sft", "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "  learning_rate: 0.0002  # recipe\n" in printed and "  use_cpu: " in printed
    assert "  max_steps: 2  # override\n" in printed and "# profile\n" not in printed
    assert "  memory_budget: 0.9  # machine\n" in printed and "memory_budget_bytes" not in printed
    said = []
    run = recipes.run_recipe("lora_sft", overrides, say=said.append)
    assert (out / "recipe.yaml").read_text() == printed  # the same resolved settings, beside run_summary.json
    assert (out / "run_summary.json").is_file()
    assert f"data {data['sft']}: {ROWS} examples" in "\n".join(said)  # every row
    assert run.summary["steps"] == 2 and not any(line.startswith("warning:") for line in said)
    assert recipes.load_trained(str(out))[0] is not None  # recipe.yaml with its comments loads back


@pytest.mark.parametrize("name,model", [("lora_dpo", "llama"), ("lora_grpo", "qwen2"),
                                        ("lora_classification", "llama")])
def test_every_recipe_trains_a_few_steps_on_a_users_model(name, model, models, data, tmp_path):
    from transformers import AutoTokenizer

    said = []
    # GRPO: a random model rarely ends its completion, so keep it short; 2 prompts x 4 completions per step
    extra = ["max_completion_length=8", "num_generations=4", "target_batch_size=8"] if name == "lora_grpo" else []
    run = recipes.run_recipe(name, [f"model={models[model]}", f"dataset={data[DATA_OF[name]]}", "max_steps=1",
                                    *FAST, f"output_dir={tmp_path}", *extra],
                             say=said.append)
    unit = {"lora_dpo": "pairs", "lora_grpo": "prompts", "lora_classification": "examples"}[name]
    assert f"{ROWS} {unit}" in "\n".join(said), said
    assert run.summary["steps"] == 1 and len(run.tokenizer) == len(AutoTokenizer.from_pretrained(models[model]))


def test_a_toy_setting_on_a_users_model_is_said_in_one_line(models):
    recipe = load_recipe("lora_sft", [f"model={models['qwen2']}", "memory_budget_bytes=20971520",
                                      "learning_rate=1e-2"])
    args = recipe.validate()
    tok = recipes.build_tokenizer(recipe)
    model = recipes.build_model(recipe, tok)
    line = toy_warning(recipe, args, model)
    assert "\n" not in line and "memory_budget_bytes=20971520 (20 MiB) is smaller than the model's weights (" in line
    assert "learning_rate=0.01" in line
    real = load_recipe("lora_sft", [f"model={models['qwen2']}"])
    assert toy_warning(real, real.validate(), model) is None
    assert toy_warning(load_recipe("lora_sft"), load_recipe("lora_sft").validate(), model) is None  # the demo
