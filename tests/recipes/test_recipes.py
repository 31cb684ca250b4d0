"""Recipes: every YAML loads and validates, overrides resolve or fail listing the valid keys, and each recipe
trains on CPU (planned with accumulation > 1, loss clearly falling), saves an adapter that reloads onto a fresh base
with the same logits, and writes its run summary."""

import json
import os
import re
import sys

import pytest
import torch
from transformers import TrainerCallback

from hf_accum import recipes
from hf_accum.cli import main
from hf_accum.recipes import RecipeError, apply_overrides, load_recipe, resolve_key

# One xdist worker runs these tests (--dist loadgroup): `run` is built once, not on each. The worker that probes the
# recipes for test_estimate_recipes.py (`recipe_probe`): the lora_sft and qlora_sft runs' probes are seeded by the same
# estimate as those probes, which a process makes once (`probing.seed.MADE`; 6 CPU-s).
pytestmark = pytest.mark.xdist_group("recipe_probe")

NAMES = ["lora_sft", "qlora_sft", "lora_classification"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models' forward passes outside the runs: 1 thread, as the recipes' cpu_threads (much faster on
    shared cores, where 2 OpenMP threads were measured 10-100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_three_recipes_ship_and_open_with_their_command():
    assert set(NAMES) <= set(recipes.available_recipes())
    for name in NAMES:
        path = recipes.recipe_path(name)
        with open(path) as f:
            assert f.readline().strip() == f"# hf-accum train {name}"
        text = path.read_text()
        assert "micro" in text and "accumulation" in text and "tokens per optimizer step" in text.lower()


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_loads_and_validates(name):
    recipe = load_recipe(name)
    args = recipe.validate()  # HfArgumentParser.parse_dict(AccumTrainingArguments), extra keys refused
    lora = recipe.lora_config()
    assert args.target_batch_size and args.tunes and args.memory_budget_bytes
    assert recipes.checkpointing_enabled(args) and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert recipe.data.dataset == "tiny" and recipe.model.name == "tiny"  # offline defaults
    if recipe.model.task == "seq_cls":
        assert args.loss_normalization == "samples" and lora.task_type == "SEQ_CLS"
    else:  # SFT through TRL: the training section is AccumSFTConfig, with TRL's GPU defaults pinned for the CPU run
        from hf_accum.trl import AccumSFTConfig

        assert isinstance(args, AccumSFTConfig) and not args.bf16 and args.use_cpu
        assert args.loss_normalization == "tokens" and lora.task_type == "CAUSAL_LM"
        # TRL's fused LM-head loss reads lm_head's weight directly: a LoRA there would not train
        assert "lm_head" not in lora.target_modules and lora.modules_to_save == ["lm_head"]
    if name == "qlora_sft":
        assert recipe.model.quantization["load_in_4bit"] and recipe.model.quantization["bnb_4bit_quant_type"] == "nf4"


def test_overrides_resolve_dotted_bare_and_aliased_keys_with_yaml_values():
    config = recipes.read_yaml(recipes.recipe_path("qlora_sft"))
    out = apply_overrides(config, [
        "max_steps=7", "learning_rate=1e-4", "r=4", "lora.target_modules=[q_proj,v_proj]",
        "model=someone/model", "dataset=data.jsonl", "model.quantization.bnb_4bit_quant_type=fp4",
        "training.report_to=null",
    ])
    assert out["training"]["max_steps"] == 7 and out["training"]["learning_rate"] == 1e-4
    assert out["lora"]["r"] == 4 and out["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert out["model"]["name"] == "someone/model" and out["data"]["dataset"] == "data.jsonl"
    assert out["model"]["quantization"]["bnb_4bit_quant_type"] == "fp4"
    assert out["training"]["report_to"] is None
    assert [recipes.parse_value(v) for v in ("no", "off", "true", "False", "1e-4")] == ["no", "off", True, False, 1e-4]
    assert "max_steps" not in config["training"]  # the original is left alone


@pytest.mark.parametrize("key,suggested", [
    ("lora.rank", "lora.r"), ("training.learning_rat", "training.learning_rate"), ("learning_rat", "training.learning_rate"),
    ("optimizer.lr", None), ("bogus", None), ("max_step", "training.max_steps"),
])
def test_an_unknown_key_is_one_line_with_the_closest_keys(key, suggested):
    with pytest.raises(RecipeError) as info:
        load_recipe("lora_sft", [f"{key}=1"])
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"unknown key {key!r}.") and len(message) < 400, message
    assert "training.* takes any field of the task's trainer config: AccumSFTConfig/" in message
    if suggested:
        assert f"Did you mean {suggested}" in message, message
    else:
        assert "sections model, data, lora, training" in message or "is not a section" in message, message


def test_ambiguous_and_nested_keys_say_what_to_write():
    with pytest.raises(RecipeError, match=r"data\.seed or training\.seed"):
        resolve_key("seed")
    with pytest.raises(RecipeError, match=r"model\.quantization accepts .*bnb_4bit_quant_type"):
        resolve_key("model.quantization.quant_type")


def test_the_cli_reports_recipe_errors_in_one_line_with_exit_2(capsys):
    assert main(["train", "lora_sft", "lora.rank=3"]) == 2
    assert capsys.readouterr().err.startswith("hf-accum train: unknown key 'lora.rank'. Did you mean lora.r")
    assert main(["train", "nope"]) == 2
    assert re.search(r"unknown recipe 'nope'.*lora_sft", capsys.readouterr().err)
    assert main(["train", "lora_sft", "max_steps=3", "--print-config"]) == 0
    assert "max_steps: 3" in capsys.readouterr().out


# Values the YAML gives but the field cannot take: refused when the recipe loads, before any model or data work.
@pytest.mark.parametrize("override,message", [
    ("learning_rate=abc", "training.learning_rate='abc' is a string, but training.learning_rate takes a number"),
    ("max_steps=abc", "training.max_steps='abc' is a string, but training.max_steps takes an integer"),
    ("max_steps=2.5", "training.max_steps=2.5 is a number, but training.max_steps takes an integer"),
    ("memory_budget=abc", "training.memory_budget='abc' is a string, but training.memory_budget takes a number"),
    ("bf16=maybe", "training.bf16='maybe' is a string, but training.bf16 takes true or false"),
    ("save_strategy=sometimes", "training.save_strategy takes one of 'no', 'steps', 'epoch', 'best'"),
    ("lora.r=abc", "lora.r='abc' is a string, but lora.r takes an integer"),
    ("lora.r=0", "lora.r=0 must be a positive integer"),
    ("lora.target_modules=3", "lora.target_modules=3 is an integer, but lora.target_modules takes a list of strings or a string or null"),
    ("data.max_length=abc", "data.max_length='abc' is a string, but data.max_length takes an integer"),
    ("model.cpu_threads=0", "model.cpu_threads=0 must be a positive integer"),
    ("resume_from_checkpoint=3", "training.resume_from_checkpoint=3 is an integer"),
    ("dataset=notes.txt", "data.dataset='notes.txt' is a .txt file; give a .json, .jsonl, .csv, .parquet file"),
    ("dataset=missing.jsonl", "data.dataset='missing.jsonl': no such file"),
    ("target_batch_size=0", "target_batch_size=0 must be a positive integer"),
    ("model.dtype=float33", "model.dtype='float33' is not a torch dtype"),
    ("model.quantization.load_in_4bit=yes", "model.quantization: load_in_4bit must be a boolean"),
])
def test_a_wrong_value_is_refused_when_the_recipe_loads(override, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(RecipeError) as info:
        load_recipe("lora_sft", [override]).validate()
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert main(["train", "lora_sft", override, "--print-config"]) == 2  # --print-config validates too
    assert message in capsys.readouterr().err


def test_a_yaml_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: tiny\ntraining:\n  max_steps: [3\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-accum train: recipe file '{bad}' line 5") and "not valid YAML" in err, err


def test_save_steps_without_save_strategy_means_steps():
    assert load_recipe("lora_sft", ["save_steps=10"]).training_args().save_strategy == "steps"
    assert load_recipe("lora_sft", ["save_steps=10", "save_strategy=no"]).training_args().save_strategy == "no"
    assert load_recipe("lora_sft").training_args().save_strategy == "no"  # the recipe's own setting


@pytest.mark.parametrize("overrides", [["checkpoint_layers=1"], ["checkpoint_layers=1", "gradient_checkpointing=null"],
                                       ["training.checkpoint_layers=1"]])
def test_checkpoint_layers_as_an_integer_wins_over_the_recipes_every_layer(overrides):
    args = load_recipe("lora_sft", overrides).training_args()
    assert args.checkpointing_choice == 1  # exactly one layer, not every layer (the recipe's gradient_checkpointing)


def test_checkpoint_layers_with_the_flag_on_the_command_line_too_is_refused():
    with pytest.raises(ValueError, match="contradict each other.*gradient_checkpointing=null"):
        load_recipe("lora_sft", ["checkpoint_layers=1", "gradient_checkpointing=true"]).validate()


@pytest.mark.parametrize("content,suffix,message", [
    ("", ".jsonl", "the file is empty"),
    ("\n\n", ".jsonl", "the file is empty"),
    ('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response":\n', ".jsonl", "line 2: not valid JSON"),
    ('{"prompt": "a", "response": "b"}\n[1, 2]\n', ".jsonl", "line 2: a JSON line must be an object"),
    ('[{"prompt": "a", "response": "b"},\n {"prompt": "c" "response": "d"}]', ".json", "line 2: not valid JSON"),
    ("prompt,response\n", ".csv", "the CSV file has a header line and no rows"),
])
def test_a_bad_data_file_is_named_with_its_line(content, suffix, message, tmp_path):
    path = tmp_path / f"data{suffix}"
    path.write_text(content)
    recipe = load_recipe("lora_sft", [f"dataset={path}"])
    with pytest.raises(RecipeError) as info:
        recipes.build_data(recipe, recipes.build_tokenizer(recipe))
    assert str(info.value).startswith(f"data.dataset={str(path)!r}") and message in str(info.value), str(info.value)


def test_lora_target_modules_that_match_nothing_list_the_layers():
    recipe = load_recipe("lora_sft", ["lora.target_modules=[qproj]"])
    args = recipe.validate()
    tok = recipes.build_tokenizer(recipe)
    with pytest.raises(RecipeError, match=r"lora\.target_modules=\['qproj'\] does not fit 'tiny'.*q_proj.*"
                                          r"all-linear") as info:
        recipes.add_lora(recipes.build_model(recipe, tok), recipe, args)
    assert "\n" not in str(info.value)


def test_4bit_without_bitsandbytes_says_what_to_install(monkeypatch):
    recipe = load_recipe("qlora_sft")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    with pytest.raises(RecipeError, match=r"needs bitsandbytes.*pip install 'bitsandbytes>=0.45' \(the qlora extra.*lora_sft"):
        recipes.build_model(recipe, recipes.build_tokenizer(recipe))


# --- real use: a local model directory and local data files (the same code path as a hub id) ------------------
def test_a_local_model_and_a_jsonl_file_of_pairs_and_chats_train_and_reload(tmp_path):
    from hf_accum import tiny

    tok = tiny.build_tokenizer()
    tiny.build_model("causal_lm", tokenizer=tok, seed=1).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    with open(tmp_path / "sft.jsonl", "w") as f:
        for i, r in enumerate(tiny.generate_instruction_data(40, seed=3)):
            chat = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
            row = {"messages": chat} if i % 2 else {"instruction": r["prompt"], "output": r["response"]}
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "out"
    run = recipes.run_recipe("lora_sft", [
        f"model={tmp_path / 'base'}", f"dataset={tmp_path / 'sft.jsonl'}", "prompt_field=instruction",
        "response_field=output", "max_steps=2", "logging_steps=1", "disable_tqdm=true", f"output_dir={out}",
    ], say=lambda _msg: None)
    assert run.summary["examples"] == 40 and run.summary["steps"] == 2
    rows = first_rows(run.trainer, 3)
    for row in rows[:2]:  # a chat row and a prompt/response row: only the answer is the target
        assert tok.decode([t for t in row["labels"] if t != -100]) in {
            r["response"] + tok.eos_token for r in tiny.generate_instruction_data(40, seed=3)[:2]}
    reloaded, _ = recipes.load_trained(str(out))
    batch = run.trainer.data_collator(rows)
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**batch).logits, run.model.eval()(**batch).logits, rtol=0, atol=1e-5)


def test_a_csv_classification_file_with_string_labels(tmp_path):
    import csv

    from hf_accum import tiny

    with open(tmp_path / "reviews.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "sentiment"])
        for r in tiny.generate_classification_data(30, seed=4):
            writer.writerow([r["text"], "even" if r["label"] else "odd"])
    recipe = load_recipe("lora_classification", [
        f"dataset={tmp_path / 'reviews.csv'}", "text_field=review", "label_field=sentiment", "model.num_labels=null",
    ])
    data = recipes.build_data(recipe, recipes.build_tokenizer(recipe))
    assert data.num_labels == 2 and len(data.dataset) == 30
    from transformers import DataCollatorWithPadding

    assert isinstance(data.collator, DataCollatorWithPadding)  # transformers' collator, not a hand-written one
    batch = data.collator(data.dataset.rows[:4])
    assert batch["labels"].tolist() == [r["labels"] for r in data.dataset.rows[:4]]
    assert {r["labels"] for r in data.dataset.rows} == {0, 1}  # "even" -> 0, "odd" -> 1 (sorted)
    with pytest.raises(RecipeError, match=r"set data\.text_field and data\.label_field"):
        recipes.build_data(load_recipe("lora_classification", [f"dataset={tmp_path / 'reviews.csv'}"]),
                           recipes.build_tokenizer(recipe))


# --- the runs ------------------------------------------------------------------------------------------------
# The recipes exactly as shipped (their default steps): on 1 CPU thread each trains in a few seconds.
RUN_OVERRIDES = {name: ["disable_tqdm=true"] for name in NAMES}
MIN_DROP = {"lora_sft": 1.0, "qlora_sft": 1.0, "lora_classification": 0.3}  # nats, first vs last logged window


class GradientsSeen(TrainerCallback):
    """Names of the trainable parameters whose gradient was non-zero before some optimizer step."""

    def __init__(self):
        self.names: set[str] = set()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.names |= {n for n, p in model.named_parameters()
                       if p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0}


def first_rows(trainer, n):
    return [trainer.train_dataset[i] for i in range(n)]


@pytest.fixture(scope="module", params=NAMES)
def run(request, tmp_path_factory):
    name = request.param
    if name == "qlora_sft":
        pytest.importorskip("bitsandbytes")
    out = tmp_path_factory.mktemp(name)
    seen = GradientsSeen()
    run = recipes.run_recipe(name, [*RUN_OVERRIDES[name], f"output_dir={out}"], say=lambda _msg: None,
                             callbacks=[seen])
    run.gradients_seen = seen.names
    return run


def test_every_adapter_parameter_received_a_gradient(run):
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and trainable == run.gradients_seen, sorted(trainable - run.gradients_seen)
    # every target module has an adapter, and lm_head (modules_to_save in the SFT recipes) trains in full
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable if ".lora_" in n}
    assert adapted == set(run.recipe.lora["target_modules"])
    if run.recipe.model.task == "causal_lm":
        assert any("lm_head.modules_to_save" in n for n in trainable), sorted(trainable)


SFT = ["lora_sft", "qlora_sft"]


@pytest.mark.parametrize("run", SFT, indirect=True)
def test_sft_tokenization_is_the_full_chat_text_tokenized(run):
    """TRL tokenizes prompt + completion as one rendered chat, as inference does, and masks the prompt."""
    from hf_accum import tiny

    tok = run.tokenizer
    pairs = tiny.generate_instruction_data(len(run.trainer.train_dataset), seed=run.recipe.data.seed, long_tailed=True)
    limit = run.trainer.args.max_length
    for i in range(0, len(pairs), 97):
        chat = [{"role": "user", "content": pairs[i]["prompt"]}, {"role": "assistant", "content": pairs[i]["response"]}]
        full = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
        prompt = tok(tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        row = run.trainer.train_dataset[i]
        assert row["input_ids"] == full[:limit]
        assert row["labels"] == ([-100] * len(prompt) + full[len(prompt):])[:limit]


@pytest.mark.parametrize("run", SFT, indirect=True)
def test_the_tiny_sft_data_has_a_long_tail_of_lengths(run):
    lengths = sorted(len(ids) for ids in run.trainer.train_dataset["input_ids"])
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert median <= 32 and p99 >= 2 * median and lengths[-1] == run.trainer.args.max_length, (median, p99)


def test_the_plan_accumulates_and_is_what_trained(run):
    plan = run.summary["plan"]
    assert plan["gradient_accumulation_steps"] > 1
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] * plan["world_size"] == (
        plan["target_batch_size"]
    )
    assert run.trainer.args.per_device_train_batch_size == plan["micro_batch_size"]
    assert run.trainer.probe_result is not None and run.summary["peak_memory_bytes"] > 0


def test_the_loss_falls_clearly(run):
    losses = [h["loss"] for h in run.summary["losses"]]
    assert len(losses) >= 6
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2  # logging_steps 5: the first and last 10 steps
    assert last < first - MIN_DROP[run.recipe.name], losses


def test_the_summary_is_written(run):
    with open(os.path.join(run.output_dir, recipes.SUMMARY_FILE)) as f:
        summary = json.load(f)
    for key in ("plan", "peak_memory_bytes", "tokens_per_second", "first_loss", "last_loss", "wall_seconds",
                "tokens_per_optimizer_step", "probe"):
        assert summary[key] is not None, key
    assert summary["tokens_per_second"] > 0 and summary["steps"] == run.trainer.state.global_step > 0
    assert summary["first_loss"] == summary["losses"][0]["loss"]
    if torch.cuda.is_available():  # a null peak is never left unexplained
        assert summary["training_peak_memory_bytes"] > 0 and "max_memory_allocated" in summary[
            "training_peak_memory_note"]
    else:
        assert summary["training_peak_memory_bytes"] is None
        assert summary["training_peak_memory_note"].startswith("not measured off CUDA")


def test_the_saved_adapter_reloads_onto_a_fresh_base_with_the_same_logits(run):
    reloaded, tok = recipes.load_trained(run.output_dir)
    assert reloaded is not run.model
    rows = first_rows(run.trainer, 6)
    batch = run.trainer.data_collator(rows)
    batch.pop("labels")
    run.model.eval()
    reloaded.eval()
    with torch.no_grad():
        want, got = run.model(**batch).logits, reloaded(**batch).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if run.recipe.model.task == "seq_cls":
        # The head is new: it is saved with the adapter (modules_to_save), or a reload would get a random one.
        from safetensors.torch import load_file

        saved = load_file(os.path.join(run.output_dir, "adapter_model.safetensors"))
        assert any(".score." in k for k in saved), sorted(saved)
        fresh = recipes.build_model(run.recipe, tok, num_labels=2)
        with torch.no_grad():
            assert not torch.allclose(fresh.eval()(**batch).logits, want, atol=1e-3)
