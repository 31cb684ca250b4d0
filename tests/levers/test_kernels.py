"""The loss kernels (hf_accum/levers/kernels/): every registered kernel that runs here, through the fused loss's seam, against
the independent float64 reference -- each sequence forwarded alone, cross-entropy by hand (log-sum-exp written out),
summed over the counted targets -- on padded rows, padding-free batches and DPO-style pairs, with prompts ignored
(-100) and label smoothing where the kernel computes it. A kernel that does not compute a setting is refused, naming
itself and the setting."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening

import hf_accum.levers.kernels.fused_loss as fl
from hf_accum.levers import kernels
from tests.exactness import lm_examples, pad_collate, tiny_llama

TOL = 1e-10
HERE = kernels.runnable("cpu", torch.float64)


def by_hand(model, examples, label_smoothing=0.0, packed=None):
    """Sum of the token losses of ``examples``, each forwarded alone, and their count (float64, no library code).
    ``packed``: a padding-free row forwarded once instead (SDPA/eager on CPU attend across its sequences, so "alone"
    would be a different model output), cut into its sequences by hand."""
    head = model.get_output_embeddings().weight
    total, count = torch.zeros((), dtype=torch.float64), 0
    states = None if packed is None else model.model(**packed).last_hidden_state[0]
    start = 0
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]])
        if states is None:
            hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
        else:
            hidden = states[start:start + ids.shape[1] - 1]
            start += ids.shape[1]
        targets = torch.tensor(ex["labels"][1:])
        keep = targets != -100
        logits = hidden[keep] @ head.T
        logp = logits - (logits - logits.max(-1, keepdim=True).values).exp().sum(-1, keepdim=True).log() \
            - logits.max(-1, keepdim=True).values
        nll = -logp.gather(1, targets[keep].unsqueeze(1)).squeeze(1)
        smooth = -logp.mean(-1)
        total = total + ((1 - label_smoothing) * nll + label_smoothing * smooth).sum()
        count += int(keep.sum())
    return total, count


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(got, want):
    return max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-300)) for n in want)


def padded(examples):
    return pad_collate(examples)


def padding_free(examples):
    return dict(DataCollatorWithFlattening(return_position_ids=True)(examples))


def pairs(examples):
    """DPO-style: each prompt with two answers (chosen, rejected), the prompt ignored in both."""
    out = []
    for a, b in zip(examples[::2], examples[1::2]):
        prompt = [t for t, lab in zip(a["input_ids"], a["labels"]) if lab == -100]
        for answer in (a, b):
            tail = [t for t, lab in zip(answer["input_ids"], answer["labels"]) if lab != -100]
            out.append({"input_ids": prompt + tail, "labels": [-100] * len(prompt) + tail})
    return out


def fused_step(model, batch, kernel, count):
    model.zero_grad(set_to_none=True)
    patch = fl.patch_model(model)
    patch.kernel = kernel
    try:
        model.train()
        loss = model(**batch, num_items_in_batch=torch.tensor(count)).loss
        loss.backward()
    finally:
        patch.remove()
    return loss.detach(), grads(model)


def reference_step(model, examples, label_smoothing=0.0, packed=None):
    model.zero_grad(set_to_none=True)
    total, count = by_hand(model, examples, label_smoothing, packed)
    (total / count).backward()
    return (total / count).detach(), grads(model), count


def test_two_kernels_run_on_this_cpu():
    assert len(HERE) >= 2 and HERE[-1] == "chunked" and "torch" in HERE


@pytest.mark.parametrize("kernel", HERE)
@pytest.mark.parametrize("layout", ["padded", "padding_free", "pairs"])
def test_kernel_matches_the_reference(kernel, layout):
    model = tiny_llama()  # SDPA keeps float64 (eager's softmax runs in float32); dropout 0: train mode is deterministic
    examples = lm_examples(8, seed=3)
    if layout == "pairs":
        examples = pairs(examples)
    batch = padding_free(examples) if layout == "padding_free" else padded(examples)
    packed = {k: batch[k] for k in ("input_ids", "position_ids")} if layout == "padding_free" else None
    want_loss, want, count = reference_step(model, examples, packed=packed)
    got_loss, got = fused_step(model, batch, kernel, count)
    assert float((got_loss - want_loss).abs() / want_loss) <= TOL
    assert want.keys() == got.keys() and rel(got, want) <= TOL


@pytest.mark.parametrize("kernel", HERE)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_the_seam_sums_counted_tokens(kernel, label_smoothing):
    """`kernels.token_loss` alone: rows labelled -100 dropped, the sum and the count returned, gradients of the
    hidden states, the weight and the bias exact; label smoothing computed or refused by name."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(101, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(101, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 101, (37,), generator=g)
    y[::3] = -100
    if label_smoothing and "label_smoothing" not in kernels.get(kernel).SETTINGS:
        with pytest.raises(ValueError, match=f"loss kernel '{kernel}' does not compute label smoothing"):
            kernels.token_loss(kernel, h, w, b, y, label_smoothing=label_smoothing)
        return
    total, count = kernels.token_loss(kernel, h, w, b, y, label_smoothing=label_smoothing)
    total.backward()
    got = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    keep = y != -100
    logits = h[keep] @ w.T + b
    logp = logits - logits.logsumexp(-1, keepdim=True)
    want = ((1 - label_smoothing) * -logp.gather(1, y[keep].unsqueeze(1)).squeeze(1)
            + label_smoothing * -logp.mean(-1)).sum()
    want.backward()
    assert int(count) == int(keep.sum()) and float((total - want).abs() / want) <= TOL
    assert all(float((a - t.grad).norm() / t.grad.norm()) <= TOL for a, t in zip(got, (h, w, b)))


@pytest.mark.parametrize("name, package", [("liger", "liger-kernel"), ("cut_ce", "cut-cross-entropy")])
def test_cuda_kernels_are_registered_with_their_rule(name, package):
    """Without their package or CUDA they do not run here, and say why in one line naming the fix."""
    why = kernels.unavailable(name, "cpu", torch.bfloat16)
    assert why is not None and name not in HERE
    assert f"pip install {package}" in why or "CUDA only" in why
    memory = kernels.get(name).memory(4096, 2048, 128256, 2)
    assert memory.peak > 0


def test_torch_kernel_is_refused_for_bf16():
    assert "rounds the token-loss sum" in kernels.unavailable("torch", "cpu", torch.bfloat16)
    assert kernels.runnable("cpu", torch.bfloat16) == ["chunked"]
    assert kernels.default("cpu", torch.float32) == "torch" and kernels.default("cpu", torch.bfloat16) == "chunked"


@pytest.mark.parametrize("measured, budget, chosen", [
    ({"torch": (1.0, 100), "chunked": (2.0, 100)}, 100, "torch"),     # the fastest
    ({"torch": (1.0, 200), "chunked": (2.0, 100)}, 150, "chunked"),   # the fastest that fits
    ({"torch": (1.0, 200), "chunked": (2.0, 300)}, 150, "torch"),     # none fits: the kernel the search ran with
    ({"torch": (1.0, 100), "chunked": (1.0, 100)}, 100, "torch"),     # a tie: the library's, registered first
    ({"chunked": (3.0, 10)}, 100, "chunked"),
])
def test_choose_is_the_fastest_that_fits(measured, budget, chosen):
    assert kernels.choose(measured, budget, "torch") == chosen


def test_forced_kernel_that_cannot_run_is_one_error():
    model = tiny_llama(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="loss kernel 'torch' cannot run here: it returns the loss in the input"):
        fused_step(copy.deepcopy(model), padded(lm_examples(2)), "torch", 10)


# --- chosen by measurement ---------------------------------------------------------------------------------------
def _tuned(tmp_path, **args):
    from hf_accum import AccumTrainer, AccumTrainingArguments

    model = tiny_llama(torch.float32)
    kwargs = dict(output_dir=str(tmp_path), target_batch_size=4, probe_seq_len=16, probe_max_micro_batch=2,
                  use_cpu=True, report_to=[], memory_budget_bytes=2**30, max_steps=1, save_strategy="no",
                  disable_tqdm=True, remove_unused_columns=False)
    trainer = AccumTrainer(model=model, args=AccumTrainingArguments(**{**kwargs, **args}),
                           train_dataset=lm_examples(8), data_collator=pad_collate)
    return trainer


def _kernels_used(monkeypatch):
    used = []
    original = kernels.token_loss

    def spy(name, *a, **k):
        used.append(name)
        return original(name, *a, **k)

    monkeypatch.setattr(kernels, "token_loss", spy)
    return used


def test_the_probe_times_each_kernel_and_training_runs_the_fastest(tmp_path, monkeypatch, caplog):
    """float32 on the CPU: torch's kernel and ours both run; the probe times a step with each at the planned
    micro-batch, the plan records the fastest that fits and the measured times, the plan line names it, and
    training runs it."""
    used = _kernels_used(monkeypatch)
    trainer = _tuned(tmp_path)
    with caplog.at_level("INFO"):
        trainer.train()
    record = trainer.plan.levers["loss_kernel"]
    assert set(record["seconds"]) == {"torch", "chunked"} and set(record["peak_bytes"]) == {"torch", "chunked"}
    assert record["micro_batch_size"] == trainer.plan.micro_batch_size
    measured = {n: (record["seconds"][n], record["peak_bytes"][n]) for n in record["seconds"]}
    assert record["kernel"] == kernels.choose(measured, 2**30, "torch")
    assert f"loss kernel {record['kernel']} (fastest)" in trainer.plan.describe()  # the times: in the plan file
    assert any(f"loss kernel {record['kernel']}" in r.getMessage() for r in caplog.records)
    probe_calls = used.index(record["kernel"], len(used) - 4)  # training's forwards come last
    assert set(used[probe_calls:]) == {record["kernel"]} and {"torch", "chunked"} <= set(used)


def test_the_kernel_recorded_is_the_one_its_recorded_times_choose(monkeypatch):
    """The plan records each kernel's time to the microsecond; the probe chooses from those figures, so two kernels
    within a microsecond are a tie, the earlier-registered wins, and the record names the kernel its own times
    choose. (Chosen from the unrounded times, a CI run recorded 'chunked' beside times whose choice is 'torch':
    test_the_probe_times_each_kernel_and_training_runs_the_fastest.)"""
    from types import SimpleNamespace

    from hf_accum.probing import kernel_timing

    patch = SimpleNamespace(kernel=None)
    monkeypatch.setattr(fl, "installed_patch", lambda model: patch)
    monkeypatch.setattr(kernel_timing, "candidates", lambda model, meter, autocast: ["torch", "chunked"])
    step = {"torch": 0.0031232, "chunked": 0.0031228}  # chunked faster by 0.4 microseconds

    class Meter:
        def measure(self, fn, micro_batch_size=None):
            return SimpleNamespace(peak_bytes=100)

        def time(self, fn, micro_batch_size=None):
            return step[patch.kernel]

    record = kernel_timing.measure_kernels(None, lambda micro: None, Meter(), 2**30, 2, False)
    assert record["seconds"] == {"torch": 0.003123, "chunked": 0.003123}
    measured = {n: (record["seconds"][n], record["peak_bytes"][n]) for n in record["seconds"]}
    assert record["kernel"] == kernels.choose(measured, 2**30, "torch") == "torch"
    step["chunked"] = 0.003122  # a microsecond faster: chosen
    assert kernel_timing.measure_kernels(None, lambda micro: None, Meter(), 2**30, 2, False)["kernel"] == "chunked"


@pytest.mark.parametrize("pinned", ["chunked", "torch"])
def test_a_pinned_kernel_is_obeyed_and_not_timed(pinned, tmp_path, monkeypatch):
    used = _kernels_used(monkeypatch)
    trainer = _tuned(tmp_path, levers=f"loss_kernel={pinned}")
    trainer.train()
    assert trainer.plan.levers["loss_kernel"] == {"kernel": pinned, "pinned": True}
    assert set(used) == {pinned} and f"loss kernel {pinned} (pinned)" in trainer.plan.describe()


def test_fused_loss_false_has_no_kernel(tmp_path, monkeypatch):
    used = _kernels_used(monkeypatch)
    trainer = _tuned(tmp_path, fused_loss=False)
    trainer.train()
    assert "loss_kernel" not in (trainer.plan.levers or {}) and not used


@pytest.mark.parametrize("pin, message", [
    ("loss_kernel=nope", "levers: loss_kernel='nope' names no loss kernel; give 'auto' or one of cut_ce, liger, torch, chunked"),
    ("loss_kernel=liger", 'levers="loss_kernel=liger": the loss kernel cannot run here: liger-kernel is not installed '
                          "(pip install liger-kernel)"),
])
def test_a_bad_pin_is_one_line_before_the_probe(pin, message, tmp_path):
    with pytest.raises(ValueError) as err:
        _tuned(tmp_path, levers=pin)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- the user's own kernel settings --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def liger_refusals(tmp_path_factory):
    """One fresh interpreter (what the arguments import is what is timed) makes the arguments with
    use_liger_kernel=True twice: without the package, then with a stand-in package on a machine without CUDA.
    Returns, per case, the seconds the arguments took to refuse and the lines of the refusal."""
    import subprocess
    import sys

    out_dir = str(tmp_path_factory.mktemp("liger"))
    code = ("import importlib.machinery, sys, time, types\n"
            "from hf_accum import AccumTrainingArguments\n"
            "def refused():\n"
            "    t = time.perf_counter()\n"
            "    try:\n"
            f"        AccumTrainingArguments(output_dir={out_dir!r}, use_liger_kernel=True, use_cpu=True, report_to=[])\n"
            "    except ValueError as e:\n"
            "        print(round(time.perf_counter() - t, 3)); print(e); print('---')\n"
            "refused()\n"
            "m = types.ModuleType('liger_kernel'); m.__spec__ = importlib.machinery.ModuleSpec('liger_kernel', None)\n"
            "sys.modules['liger_kernel'] = m\n"
            "refused()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    cases = [part.strip().splitlines() for part in out.stdout.split("---")[:2]]
    assert len(cases) == 2 and all(cases), out
    return {"no package": (cases[0][0], cases[0][1:]), "off cuda": (cases[1][0], cases[1][1:])}


@pytest.mark.xdist_group("liger_refusals")  # one worker, one interpreter for both
def test_use_liger_kernel_without_the_package_is_one_line_at_once(liger_refusals):
    """Refused as the arguments are made (before any model work), in one line naming the pip command: not
    transformers' ImportError after the probe."""
    import importlib.util

    assert importlib.util.find_spec("liger_kernel") is None  # this environment has no liger-kernel
    seconds, message = liger_refusals["no package"]
    assert len(message) == 1 and "pip install liger-kernel" in message[0] and "use_liger_kernel=True" in message[0]
    assert float(seconds) <= 2.0, seconds


LIGER_ROUTES = [  # (liger_kernel_config, fused_loss, device) -> (config transformers applies, kernel) or refusal
    ({}, None, "cuda", {"fused_linear_cross_entropy": False}, "liger"),
    (None, True, "cuda", {"fused_linear_cross_entropy": False}, "liger"),
    ({"rms_norm": False, "cross_entropy": True}, None, "cuda",
     {"rms_norm": False, "cross_entropy": True, "fused_linear_cross_entropy": False}, "liger"),
    ({"fused_linear_cross_entropy": False}, False, "cuda", {"fused_linear_cross_entropy": False}, None),
    ({}, None, "cpu", "use_liger_kernel=True: Liger's kernels are Triton kernels for CUDA only, and this run is on cpu; "
                      "set use_liger_kernel=False", None),
    ({"fused_linear_cross_entropy": True}, None, "cuda",
     "liger_kernel_config={'fused_linear_cross_entropy': True} replaces the model's forward", None),
]


@pytest.mark.parametrize("config, fused_loss, device, want, kernel", LIGER_ROUTES)
def test_use_liger_kernel_routes_to_one_loss_path(config, fused_loss, device, want, kernel):
    """Liger's own fused cross-entropy patch off (it would replace the forward our fused loss patches), its other
    kernels as given, and Liger's kernel run by our fused loss (None: fused_loss=False, the model's own loss)."""
    from hf_accum.levers.kernels import liger

    given = None if config is None else dict(config)
    if isinstance(want, str):
        with pytest.raises(ValueError) as err:
            liger.route(given, fused_loss, device)
        assert str(err.value).startswith(want) and "\n" not in str(err.value)
        return
    assert liger.route(given, fused_loss, device) == (want, kernel)
    assert given == config  # the caller's dict is not written to


def _fake_liger(monkeypatch):
    """A stand-in liger-kernel (not installed here; its kernels are Triton, CUDA only): importable, with its fused
    linear cross-entropy written in plain torch (Liger's contract: the sum over counted targets)."""
    import importlib.machinery
    import sys
    import types

    calls = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                                         reduction="mean"):
        calls.append(tuple(input.shape))
        logits = torch.nn.functional.linear(input, weight, bias)
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index,
                                                 label_smoothing=label_smoothing, reduction=reduction)

    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.functional"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["liger_kernel.transformers.functional"].liger_fused_linear_cross_entropy = \
        liger_fused_linear_cross_entropy
    return calls


@pytest.mark.xdist_group("liger_refusals")  # one worker, one interpreter for both
def test_use_liger_kernel_off_cuda_is_one_line_at_once(liger_refusals):
    """With the package there but no CUDA device (Triton kernels): refused as the arguments are made, one line
    naming the setting, not Triton's error at the first forward after the probe (the second case of
    `liger_refusals`' interpreter, after a stand-in package is put in sys.modules)."""
    seconds, message = liger_refusals["off cuda"]
    assert len(message) == 1 and "use_liger_kernel=True" in message[0] and "CUDA only" in message[0], message
    assert float(seconds) <= 2.0


@pytest.mark.parametrize("fused_loss", [None, False])
def test_use_liger_kernel_runs_liger_in_our_fused_loss_exactly_and_names_it(fused_loss, tmp_path, monkeypatch,
                                                                            caplog):
    """use_liger_kernel=True (a stand-in Liger, the device check passed as on CUDA): transformers applies Liger's
    kernels with its fused cross-entropy off, so the model's forward stays hf_accum's fused-loss patch; that runs
    Liger's kernel, the plan line names it, and the gradients match the independent float64 reference. With
    fused_loss=False the loss is the model's own from its full logits, and the plan line says that instead."""
    import transformers.trainer
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.levers.kernels import liger
    from tests.exactness import StepRecorder, max_relative_error, recording, reference_run

    calls = _fake_liger(monkeypatch)
    configure = getattr(liger, "configure", None)  # None on a main without it: the test fails on what it checks
    monkeypatch.setattr(liger, "configure", lambda args, device: configure(args, "cuda"), raising=False)
    monkeypatch.setattr(liger, "unavailable", lambda *a, **k: None)  # the stand-in runs on the CPU
    applied, made, probed_first = [], [], []

    def apply_liger_kernel(model, config):  # what Liger does to the instance: its fused cross-entropy (on unless
        applied.append(dict(config or {}))  # turned off) replaces the model's forward
        probed_first.append(made[0].probe_result is not None)  # docs/plan.md: the probe runs before Liger's kernels
        if (config or {}).get("fused_linear_cross_entropy", True):
            model.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("Liger's own loss path ran"))

    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", apply_liger_kernel)
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), target_batch_size=4, probe_seq_len=16, probe_max_micro_batch=2, use_cpu=True,
        report_to=[], memory_budget_bytes=2**30, max_steps=2, save_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, use_liger_kernel=True, learning_rate=1e-2, max_grad_norm=0.0,
        fused_loss=fused_loss)
    assert args.liger_kernel_config == {"fused_linear_cross_entropy": False}
    recorder = StepRecorder()
    trainer = recording(AccumTrainer)(model=tiny_llama(), args=args, train_dataset=lm_examples(8),
                                      data_collator=pad_collate, callbacks=[recorder])
    made.append(trainer)
    trainer.remove_callback(PrinterCallback)
    with caplog.at_level("WARNING", logger="hf_accum"):
        trainer.train()
    assert applied == [{"fused_linear_cross_entropy": False}] and probed_first == [True]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_accum plan: "))
    if fused_loss is False:
        assert "loss_kernel" not in (trainer.plan.levers or {}) and not calls
        assert "; loss from the full logits (fused loss off); Liger's other kernels (use_liger_kernel=True); " in line
    else:
        record = {"kernel": "liger", "pinned": True, "by": "use_liger_kernel=True"}
        assert trainer.plan.levers["loss_kernel"] == record and calls  # the probe's and training's forwards
        assert "; loss kernel liger (use_liger_kernel=True)" in line
    ref = reference_run(tiny_llama(), recorder, trainer.windows, "causal")
    # the model's own loss upcasts the logits to float32 (transformers' ForCausalLMLoss): ~1e-7 on a float64 model
    assert max_relative_error(recorder.grads, ref.grads) <= (1e-6 if fused_loss is False else TOL)


def test_use_liger_kernel_with_trls_fused_head_is_one_loss_path_named_in_the_plan_line(tmp_path, monkeypatch,
                                                                                         caplog):
    """AccumSFTTrainer: TRL's own fused LM head computes the loss (Liger's fused cross-entropy off, neither Liger's
    loss nor hf_accum's kernel runs), the plan line says so, and training is exact."""
    import warnings

    import transformers.trainer
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import tiny
    from hf_accum.levers.kernels import liger
    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer
    from tests.exactness import StepRecorder, max_step_error, recording, reference_run

    calls = _fake_liger(monkeypatch)
    configure = getattr(liger, "configure", None)  # None on a main without it: the test fails on what it checks
    monkeypatch.setattr(liger, "configure", lambda args, device: configure(args, "cuda"), raising=False)
    applied = []
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", lambda model, config: applied.append(config))
    tok = tiny.build_tokenizer()
    rows = tiny.generate_instruction_data(8, seed=1)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    initial = copy.deepcopy(model)
    args = AccumSFTConfig(output_dir=str(tmp_path), target_batch_size=4, probe_max_micro_batch=2, max_steps=2,
                          learning_rate=1e-2, max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True,
                          bf16=False, seed=0, disable_tqdm=True, max_length=64, use_liger_kernel=True)
    recorder = StepRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL: use_liger_kernel is deprecated there
        trainer = recording(AccumSFTTrainer)(model=model, args=args, train_dataset=data, processing_class=tok,
                                             callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    with caplog.at_level("WARNING", logger="hf_accum"):
        trainer.train()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_accum plan: "))
    assert ("; loss by TRL's fused LM head (trl.trainer.utils.add_fused_lm_head); Liger's other kernels "
            "(use_liger_kernel=True); ") in line and "loss kernel" not in line
    assert "loss_kernel" not in (trainer.plan.levers or {}) and not calls
    assert applied == [{"fused_linear_cross_entropy": False}]
    ref = reference_run(initial, recorder, trainer.windows, "causal")
    assert max_step_error(recorder, ref) < 1e-6  # float64 model; RMSNorm/rotary in float32 give ~1e-7 (test_trl)


# --- the estimate sees the kernel ------------------------------------------------------------------------------------
def _qwen2_tied():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=8192, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True)


@pytest.mark.parametrize("lora", [False, True])
def test_the_estimate_of_the_fused_loss_matches_the_probe(lora):
    """Default settings (the fused loss on, torch's kernel for float32 on the CPU, run on paper as its memory model):
    the estimate's peaks within 5% of the probe's measured ones, and the same largest fit. Qwen2 with tied
    embeddings (the head's gradient meets the embedding's) and with LoRA (the head frozen)."""
    from transformers import AutoModelForCausalLM

    from hf_accum.probing.estimate import estimate_model
    from hf_accum.probing.paper import with_fused_loss, with_lora
    from hf_accum.probing.probe import probe_model

    config = _qwen2_tied()
    build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    build = with_lora(build, 8, "q_proj,v_proj") if lora else build
    build = with_fused_loss(build, None)
    budget = (24 if lora else 40) * 2**20
    torch.manual_seed(0)
    model = build()
    assert fl.installed_patch(model) is not None
    result, _ = probe_model(model, seq_len=128, target_batch_size=16, budget_bytes=budget)
    measured = {t.micro_batch_size: t.peak_bytes for t in result.measured_trials if t.peak_bytes}
    est = estimate_model(build, seq_len=128, target_batch_size=16, device="cpu", device_memory=64 * 2**30,
                         budget_bytes=budget, also=tuple(measured))
    assert "kernel torch" in est.loss and "memory model" in est.loss
    errors = {m: est.peaks[m] / peak - 1 for m, peak in measured.items()}
    assert len(measured) >= 2 and all(abs(e) <= 0.05 for e in errors.values()), errors
    assert 1 < result.max_micro_batch_size < 16 and est.result.max_micro_batch_size == result.max_micro_batch_size


def test_fused_loss_flags_change_the_cli_estimate(tmp_path, capsys):
    from hf_accum.cli import main

    _qwen2_tied().save_pretrained(tmp_path)
    common = ["probe", "--estimate", "--model", str(tmp_path), "--device", "cpu", "--device-memory", "1GiB",
              "--seq-len", "128", "--target-batch", "16", "--budget-bytes", str(40 * 2**20)]
    out = {}
    for flag in ("--fused-loss", "--no-fused-loss"):
        assert main(common + [flag, "--json", str(tmp_path / f"{flag}.json")]) == 0
        printed = capsys.readouterr().out
        import json

        out[flag] = (json.loads((tmp_path / f"{flag}.json").read_text()), printed)
    fused, plain = out["--fused-loss"], out["--no-fused-loss"]
    assert "assumed: loss: the fused loss, kernel torch" in fused[1]
    assert "assumed: loss: the model's own, from the full logits" in plain[1]
    assert fused[0]["max_micro_batch_size"] > plain[0]["max_micro_batch_size"]
    assert fused[0]["peaks"]["1"] < plain[0]["peaks"]["1"]
