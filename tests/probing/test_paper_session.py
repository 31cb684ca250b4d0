"""One model on paper for many cards (`probing/paper_session.py`): a size stepped once is not stepped again, and a
size measured after others measures what it would first (the reason the grid may share the model: every cell is
also checked against that card's own estimate in tests/probing/test_fits.py)."""

import pytest
import torch

from hf_accum.probing import paper
from hf_accum.probing.paper_meter import PaperMeter
from hf_accum.probing.paper_session import OneAtATime, PaperSession

MiB = 2**20


def _session(folder, *, lora, checkpoint_layers=None, quantization=None, seq_len=256):
    build = paper.builder(folder, 8 if lora or quantization else None, None, None)
    options = None if quantization is None else {"compute_dtype": torch.bfloat16, "double_quant": False}
    return PaperSession(build, seq_len=seq_len, device="cuda", bf16=quantization is not None, capacity=1024 * MiB,
                        quantization=quantization, quantization_options=options, checkpoint_layers=checkpoint_layers)


def _measured(session, sizes):
    out = {}
    for m in sizes:
        got = session.meter.measure(lambda m=m: session._step(m), micro_batch_size=m)
        out[m] = (got.peak_bytes, got.reserved_bytes)
    return out


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@pytest.mark.parametrize("lora, checkpoint_layers, quantization", [
    (False, None, None), (True, None, None), (True, "all", None), (False, None, "nf4")],
    ids=["full", "lora", "lora-checkpointed", "qlora"])
def test_a_size_measured_after_others_measures_what_it_would_first(llama_folder, monkeypatch, expandable, lora,
                                                                    checkpoint_layers, quantization):
    """Peak and reserved bytes (the allocator model, both kinds of segments) of each size measured in one session
    after the warm-up and other sizes, larger and smaller, equal a fresh session's that warms up and measures that
    size alone."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", f"expandable_segments:{expandable}")
    order = (3, 1, 5, 2)
    with _session(llama_folder, lora=lora, checkpoint_layers=checkpoint_layers, quantization=quantization) as s:
        s._step(1)  # the warm-up, as the first search runs it
        shared = _measured(s, order)
    for m in order:
        with _session(llama_folder, lora=lora, checkpoint_layers=checkpoint_layers, quantization=quantization) as s:
            s._step(1)
            assert _measured(s, [m]) == {m: shared[m]}, m
    assert shared[5][1] > shared[1][1] and len({v for v in shared.values()}) == len(order)  # sizes differ


def test_a_later_search_steps_only_the_sizes_not_stepped_before(llama_folder, monkeypatch):
    """The second card's search reads the sizes the first one stepped; only its new sizes run, and the warm-up runs
    once."""
    stepped = []
    real = PaperMeter.measure
    monkeypatch.setattr(PaperMeter, "measure", lambda self, fn, *, micro_batch_size=None: (
        stepped.append(micro_batch_size), real(self, fn, micro_batch_size=micro_batch_size))[1])
    warmups = []
    real_time = PaperMeter.time
    monkeypatch.setattr(PaperMeter, "time", lambda self, fn, *, micro_batch_size=None: (
        warmups.append(micro_batch_size), real_time(self, fn, micro_batch_size=micro_batch_size))[1])
    with _session(llama_folder, lora=True) as s:
        large = s.fit(60 * MiB, 32, 32)
        first = list(stepped)
        small = s.fit(30 * MiB, 32, 32)
    assert warmups == [1]
    assert len(first) == len(set(first)) == len(large.trials)
    assert 1 in first and stepped[len(first):] == [t.micro_batch_size for t in small.trials
                                                   if t.micro_batch_size not in first]
    assert small.max_micro_batch_size < large.max_micro_batch_size
    assert [t.micro_batch_size for t in small.trials][0] == 1  # read back, not stepped


def test_a_session_refuses_a_sequence_longer_than_the_models_positions(llama_folder):
    with pytest.raises(ValueError, match="seq_len=8192 exceeds the model's max_position_embeddings=4096"):
        with _session(llama_folder, lora=False, seq_len=8192):
            pass
    with pytest.raises(ValueError, match="a session holds one level"):
        _session(llama_folder, lora=False, checkpoint_layers="auto")


class _Stub:
    def __init__(self, key, log):
        self.key, self.log = key, log

    def __enter__(self):
        self.log.append(("open", self.key))
        return self

    def __exit__(self, *exc):
        self.log.append(("close", self.key))


def test_one_session_at_a_time():
    log = []
    with OneAtATime(lambda *key: _Stub(key, log)) as sessions:
        a = sessions(512, None)
        assert sessions(512, None) is a  # the same key: the open one
        b = sessions(512, "all")
        assert b is not a and sessions(2048, None).key == (2048, None)
    assert log == [("open", (512, None)), ("close", (512, None)), ("open", (512, "all")), ("close", (512, "all")),
                   ("open", (2048, None)), ("close", (2048, None))]


def test_the_paper_meter_steps_only_the_warm_up():
    """A timing on paper says 0.0; it runs the step only while the optimizer has no state (the warm-up creates it),
    not the level search's later timings (a step after the warm-up leaves what is live as it found it)."""
    from types import SimpleNamespace

    from hf_accum.probing.paper_meter import StorageCounter

    meter = PaperMeter(StorageCounter(), torch.nn.Linear(2, 2), 1024, "cpu")
    try:
        ran = []
        assert meter.time(lambda: ran.append("no optimizer yet")) == 0.0
        meter.optimizer = SimpleNamespace(state={})
        assert meter.time(lambda: ran.append("no state yet")) == 0.0
        meter.optimizer = SimpleNamespace(state={"weight": {"step": 1}})
        assert meter.time(lambda: ran.append("warm")) == 0.0
        assert ran == ["no optimizer yet", "no state yet"]
    finally:
        meter.close()
