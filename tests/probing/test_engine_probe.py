"""The engine probe's agreement, without an engine: every rank's search must read the same figures (the largest over
the ranks), one exchange per trial, and an out-of-memory error must stop every rank rather than be skipped on one.
The real thing, through DeepSpeed on two ranks, is in tests/integrations/test_deepspeed.py."""

import pytest

from hf_accum.probing.agreed import AgreedMeter, smallest
from hf_accum.probing.loop import probe_micro_batches
from hf_accum.probing.meters import FakeMeter
from hf_accum.probing.probe import probe_model
from hf_accum.window.protocol import StopTraining

MiB = 2**20


class PeerCollective:
    """Two ranks, seen from this one: the peer's measurement of the size this rank just ran is ``peer(micro)``."""

    world = 2

    def __init__(self, mine: FakeMeter, peer, peer_limits=None):
        self.mine, self.peer, self.peer_limits = mine, peer, peer_limits
        self.exchanges: list[tuple[int, ...]] = []
        self.announced: list[str] = []

    def max_of(self, values):
        self.exchanges.append(tuple(values))
        if len(values) != 5:  # the budget and limit (negated: `smallest`): the peer's equal unless given
            return tuple(values) if self.peer_limits is None else tuple(
                max(v, -p) for v, p in zip(values, self.peer_limits))
        peer = (int(self.peer(self.mine.calls[-1])), -1, 0, 0, 0)
        return tuple(max(a, b) for a, b in zip(values, peer))

    def announce_stop(self, reason):
        self.announced.append(reason)

    def peer_stop(self):
        return None


def _trials(meter, budget=100 * MiB, cap=16):
    result = probe_micro_batches(lambda micro: None, meter, budget, cap, must_resolve=[1, 2, 4, 8, 16])
    return [(t.micro_batch_size, t.peak_bytes, t.status) for t in result.trials], result.max_micro_batch_size


@pytest.mark.parametrize("mine, peer", [
    (lambda m: 10 * MiB + 5 * MiB * m, lambda m: 10 * MiB + 7 * MiB * m),   # the peer needs more per row
    (lambda m: 30 * MiB + 5 * MiB * m, lambda m: 10 * MiB + 6 * MiB * m),   # lines that cross
    (lambda m: 10 * MiB + 6 * MiB * m, lambda m: 10 * MiB + 6 * MiB * m),   # equal ranks
])
def test_each_rank_searches_the_largest_figures_over_the_ranks(mine, peer):
    meter = FakeMeter(mine, 10**12)
    collective = PeerCollective(meter, peer)
    agreed = _trials(AgreedMeter(meter, collective, "DeepSpeed ZeRO-3", "memory_budget"))
    # the same search run on the worse of the two ranks at every size: what the peer's search also sees
    expected = _trials(FakeMeter(lambda m: max(mine(m), peer(m)), 10**12))
    assert agreed == expected
    assert len(collective.exchanges) == len(meter.calls) == len(expected[0])  # one exchange per measured trial


def _probed(meter, budget, collective=None):
    from tests.exactness import tiny_llama

    result, plan = probe_model(tiny_llama(), seq_len=8, target_batch_size=16, budget_bytes=budget, meter=meter,
                               collective=collective)
    return [(t.micro_batch_size, t.peak_bytes, t.status) for t in result.trials], plan.micro_batch_size


@pytest.mark.parametrize("peer_budget", [100 * MiB, 80 * MiB])
def test_a_model_sharded_in_place_is_probed_in_lockstep_on_the_worse_ranks_figures(peer_budget):
    """`probe_model(collective=...)` (FSDP2: every probe step all-gathers): one exchange agrees the budget and the
    limit (the smallest), then one per measured trial (the largest peak); every rank runs the trials the worse
    rank's search runs. Here the peer holds 4 MiB more from micro-batch 2 on: searched alone, this rank would stop
    after three trials while the peer ran a fourth, all-gathering for a forward no other rank runs (the hang
    tests/integrations/test_fsdp2.py met)."""
    mine = lambda m: 10 * MiB + 5 * MiB * m  # noqa: E731
    peer = lambda m: mine(m) + (4 * MiB if m > 1 else 0)  # noqa: E731
    meter = FakeMeter(mine, 10**12)
    collective = PeerCollective(meter, peer, peer_limits=(peer_budget, 10**12))
    agreed = _probed(meter, 100 * MiB, collective)
    expected = _probed(FakeMeter(lambda m: max(mine(m), peer(m)), 10**12), min(peer_budget, 100 * MiB))
    assert agreed == expected
    alone = _probed(FakeMeter(mine, 10**12), 100 * MiB)
    assert len(alone[0]) < len(agreed[0])  # searched alone, this rank would leave the search first
    assert collective.exchanges[0] == (-100 * MiB, -(10**12))  # the budget and the limit, first and once
    assert len(collective.exchanges) == 1 + len(meter.calls)  # then one per measured trial


def test_one_rank_probes_alone_whatever_collective_it_is_given():
    meter = FakeMeter(lambda m: 10 * MiB + 5 * MiB * m, 10**12)
    collective = PeerCollective(meter, lambda m: 0)
    collective.world = 1
    assert _probed(meter, 100 * MiB, collective) == _probed(FakeMeter(meter.memory, 10**12), 100 * MiB)
    assert collective.exchanges == []


def test_an_out_of_memory_error_stops_every_rank_with_what_to_set():
    meter = FakeMeter(lambda m: 10 * MiB * m, 35 * MiB)  # after micro 1 the search tries the cap, 16: it raises
    collective = PeerCollective(meter, lambda m: 0)
    with pytest.raises(StopTraining) as info:
        _trials(AgreedMeter(meter, collective, "DeepSpeed ZeRO-3", "memory_budget_bytes or memory_budget"),
                budget=10**9)
    message = ("out of memory while the probe ran micro-batch 16 through DeepSpeed ZeRO-3, where no rank can skip a "
               "size the others run; lower memory_budget_bytes or memory_budget or set probe_max_micro_batch below 16")
    assert str(info.value) == message and collective.announced == [message]


def test_out_of_memory_at_micro_batch_1_names_what_shrinks_a_step():
    meter = FakeMeter(lambda m: 10 * MiB * m, 5 * MiB)
    collective = PeerCollective(meter, lambda m: 0)
    with pytest.raises(StopTraining, match="micro-batch 1 .* to fit micro-batch 1, enable gradient_checkpointing"):
        AgreedMeter(meter, collective, "DeepSpeed ZeRO-2", "memory_budget").measure(lambda: None, micro_batch_size=1)


def test_other_errors_pass_through_untouched():
    meter = FakeMeter(lambda m: MiB, 10**9)
    agreed = AgreedMeter(meter, PeerCollective(meter, lambda m: 0), "DeepSpeed ZeRO-2", "memory_budget")

    def fails():
        raise ValueError("a bug in the step")

    with pytest.raises(ValueError, match="a bug in the step"):
        agreed.measure(fails, micro_batch_size=2)


def test_smallest_is_one_exchange():
    class Ranks:
        world = 2
        calls = 0

        def max_of(self, values):
            self.calls += 1
            return tuple(max(v, p) for v, p in zip(values, (-70, -9)))  # the peer holds 70 and 9

    ranks = Ranks()
    assert smallest(ranks, 100, 5) == (70, 5) and ranks.calls == 1


# --- "nothing fits" under DeepSpeed: its buffers or the model? -------------------------------------------------
GiB = 2**30
DEFAULT_BUCKETS = {"reduce_bucket_size": 5 * 10**8, "allgather_bucket_size": 5 * 10**8}


@pytest.mark.parametrize("need, state, buckets, dominate", [
    (int(1.86 * GiB), 3 * MiB, DEFAULT_BUCKETS, True),           # a tiny model under ZeRO-2's default buckets
    (int(1.86 * GiB), 3 * MiB, {"reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6}, False),  # small buckets
    (int(20 * GiB), 2 * GiB, DEFAULT_BUCKETS, False),            # activations: the buckets are a tenth of the step
    (int(3 * GiB), int(2 * GiB), DEFAULT_BUCKETS, False),       # the model's states are most of the step
    (int(1.86 * GiB), 3 * MiB, {}, False),                        # ZeRO-0: no buckets
])
def test_buffers_dominate_is_decided_from_the_measured_step(need, state, buckets, dominate):
    from hf_accum.probing.engine import buffers_dominate

    assert buffers_dominate(need, state, buckets, 4) is dominate


def test_the_buffer_message_names_the_keys_and_not_checkpointing():
    from hf_accum.probing.engine import buffers_message

    message = buffers_message("DeepSpeed ZeRO-2", int(1.86 * GiB), 64 * MiB, 3 * MiB, DEFAULT_BUCKETS, 4)
    assert message.startswith("even micro-batch 1 does not fit: one training step through DeepSpeed ZeRO-2 needs "
                              "1.860 GiB against a budget of 64.0 MiB, and the model's weights, gradients and "
                              "optimizer state are only 3.0 MiB: the rest is mostly DeepSpeed's own communication "
                              "buffers (reduce_bucket_size=500000000, allgather_bucket_size=500000000 elements")
    assert '"reduce_bucket_size": 1000000, "allgather_bucket_size": 1000000' in message  # under a tenth of 64 MiB
    assert "gradient checkpointing or LoRA would not shrink them" in message


def test_model_state_bytes_counts_weights_gradients_and_adam_moments():
    import torch

    from hf_accum.probing.engine import model_state_bytes

    trained, frozen = torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(5), requires_grad=False)
    assert model_state_bytes([trained, frozen]) == 10 * (4 + 4 + 8) + 5 * 4


def test_an_out_of_memory_error_at_micro_batch_one_names_the_buffers_where_they_dominate():
    meter = FakeMeter(lambda m: 10 * MiB * m, 5 * MiB)  # micro-batch 1 itself runs out of memory
    advice = 'DeepSpeed\'s own communication buffers (...): set smaller ones in the DeepSpeed config\'s "zero_optimization"'
    collective = PeerCollective(meter, lambda m: 0)
    agreed = AgreedMeter(meter, collective, "DeepSpeed ZeRO-2", "memory_budget", fit_one=advice)
    with pytest.raises(StopTraining, match=r"micro-batch 1 through DeepSpeed ZeRO-2.*; DeepSpeed's own communication"):
        probe_micro_batches(lambda micro: None, agreed, 100 * MiB, 16, must_resolve=[1, 2, 4, 8, 16])
    assert collective.announced and "zero_optimization" in collective.announced[0]


class EqualPeers:
    """Ranks that measure what this one measures: each exchange recorded, each value returned as given."""

    world = 2

    def __init__(self):
        self.exchanges: list[tuple[int, ...]] = []

    def max_of(self, values):
        self.exchanges.append(tuple(values))
        return tuple(values)

    def announce_stop(self, reason):
        raise AssertionError(f"no rank stops here: {reason}")


@pytest.mark.parametrize("in_place", [True, False], ids=["sharded in place", "each rank alone"])
def test_the_trainer_probes_in_lockstep_where_its_engine_says_the_probe_steps_run_collectives(tmp_path, in_place,
                                                                                             monkeypatch):
    """`tuning.measure` hands the probe the trainer's collective where `Engine.probe_runs_collectives` (FSDP2's
    model sharded in place: `engines/fsdp.py`), and none elsewhere (DDP probes the unwrapped model)."""
    from hf_accum.tiny import build_tokenizer
    from tests.conftest import sft_trainer

    trainer = sft_trainer(build_tokenizer(), output_dir=str(tmp_path), target_batch_size=16,
                          memory_budget_bytes=8 * MiB, max_steps=1)
    peers = EqualPeers()
    monkeypatch.setattr(trainer.engine, "probe_runs_collectives", in_place)
    monkeypatch.setattr(trainer, "_collective", lambda: peers)
    plan = trainer.tune()
    measured = [t for t in trainer.probe_result.trials if t.peak_bytes is not None]
    stored, *probe = peers.exchanges
    assert stored == (0, 0)  # every rank says whether it found a stored plan (`tuning.agreed_stored`), as before
    if in_place:  # the budget and the limit once, then one exchange per measurement (each trial, each loss kernel)
        assert probe[0][0] == -8 * MiB and all(len(e) == 5 for e in probe[1:])
        assert [t.peak_bytes for t in measured] == [e[0] for e in probe[1:1 + len(measured)]]
    else:
        assert probe == []
    assert plan.micro_batch_size > 1 and measured
