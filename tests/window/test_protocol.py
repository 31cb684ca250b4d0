"""The window protocol with a fake collective that counts every call: on every path, each rank makes the same
collective calls in the same order (the invariant in protocol.py), and the engine re-runs or stops as its
policy says. No model, no process group: the engine drives a fake forward/backward."""

import pytest
import torch

from hf_accum.window.engine import WindowEngine
from hf_accum.window.loss import LabelSpec
from hf_accum.window.protocol import Local, Phase, Policy, StopTraining, WindowProtocol
from hf_accum.window.units import make_cutter


class FakeCollective:
    """Rank-local view of a 2-rank group: records this rank's calls; the other rank's flags are scripted."""

    world = 2

    def __init__(self, other_flags=()):
        self.calls: list[tuple] = []
        self.other_flags = list(other_flags)

    def sum(self, value):
        self.calls.append(("sum",))
        return value * 2  # the other rank holds as many

    def any(self, flag):
        self.calls.append(("any", flag))
        other = self.other_flags.pop(0) if self.other_flags else False
        return flag or other

    def max_of(self, values):
        self.calls.append(("max_of", values))
        return values  # the other rank needs as many forwards

    def any_of(self, flags):
        self.calls.append(("any_of", flags))
        other = self.other_flags.pop(0) if self.other_flags else (False,) * len(flags)
        return tuple(a or b for a, b in zip(flags, other))

    announced = None  # what this rank left in the store when it stopped (not a collective: not in `calls`)
    peer_reason = None  # what the other rank left there

    def announce_stop(self, reason):
        self.announced = reason

    def peer_stop(self):
        return self.peer_reason


def oom():
    return torch.OutOfMemoryError("CUDA out of memory (injected)")


class FakeRank:
    """A rank's forward/backward: counts forwards, raises OOM where scripted ("fwd:N", "bwd:N", 1-based)."""

    def __init__(self, engine, fail=()):
        self.engine, self.fail, self.forwards, self.backwards, self.sizes = engine, set(fail), 0, 0, []

    def run_chunk(self, chunk, final):
        def forward(b):
            self.forwards += 1
            if f"fwd:{self.forwards}" in self.fail:
                raise oom()
            self.sizes.append(b["input_ids"].shape[0])
            return torch.tensor(1.0)

        if final:
            out, keep = self.engine.final_forward(forward, chunk)
        else:
            out, keep = forward(chunk), 1.0
        self.backwards += 1
        if f"bwd:{self.backwards}" in self.fail:
            raise oom()
        return out * keep


def batches(n=2, rows=4):
    return [{"input_ids": torch.ones(rows, 3, dtype=torch.long), "labels": torch.ones(rows, 3, dtype=torch.long)}
            for _ in range(n)]


def engine(collective, policy=Policy.RERUN, shrink=lambda units: 2):
    cutter = make_cutter("rows", LabelSpec())
    return WindowEngine(cutter, "tokens", WindowProtocol(collective, policy), shrink=shrink)


def run_window(eng, rank, window):
    eng.begin(window)
    return [eng.step(b, rank.run_chunk) for b in window]


def test_normal_window_makes_four_collectives():
    c = FakeCollective()
    eng = engine(c)
    rank = FakeRank(eng)
    run_window(eng, rank, batches())
    assert c.calls == [("sum",), ("any", False), ("any", False), ("any_of", (False, False))]
    assert rank.forwards == 2 and eng.protocol.phase is Phase.IDLE


def test_oom_mid_window_skips_then_reruns_together():
    c = FakeCollective()
    eng = engine(c)
    rank = FakeRank(eng, fail={"fwd:1"})
    run_window(eng, rank, batches())
    # count; before-final says "I ran out" -> all restart; the re-run agrees on its forwards per loaded batch, then
    # before/after final again
    assert c.calls == [("sum",), ("any", True), ("max_of", (2, 2)), ("any", False), ("any", False),
                       ("any_of", (False, False))]
    assert rank.sizes == [2, 2, 2, 2] and eng.cut_units == 2  # the whole window again, cut at 2 rows


def test_other_ranks_oom_mid_window_restarts_this_one_too():
    c = FakeCollective(other_flags=[True])  # the other rank reports an OOM before the final forward
    eng = engine(c)
    rank = FakeRank(eng)
    run_window(eng, rank, batches())
    assert c.calls == [("sum",), ("any", False), ("max_of", (2, 2)), ("any", False), ("any", False),
                       ("any_of", (False, False))]
    assert rank.sizes == [4, 2, 2, 2, 2]  # its first forward ran, then the window again at the smaller cut


def test_oom_in_the_final_forward_drains_then_reruns():
    c = FakeCollective()
    eng = engine(c)
    rank = FakeRank(eng, fail={"fwd:2"})
    run_window(eng, rank, batches())
    # before-final (no OOM yet), after-final (mine) -> a drain iteration on a sliver, then re-run
    assert c.calls == [("sum",), ("any", False), ("any", True), ("max_of", (2, 2)), ("any", False), ("any", False),
                       ("any_of", (False, False))]
    assert rank.sizes[:2] == [4, 1]  # the drain forward ran one row (a sliver)
    assert rank.sizes[2:] == [2, 2, 2, 2]


def test_oom_in_the_final_backward_stops_every_rank():
    c = FakeCollective()
    eng = engine(c)
    rank = FakeRank(eng, fail={"bwd:2"})
    with pytest.raises(StopTraining, match="gradient-synchronizing backward"):
        run_window(eng, rank, batches())
    assert c.calls == [("sum",), ("any", False), ("any", False)]


@pytest.mark.parametrize("fail", ["fwd:1", "fwd:2", "bwd:1", "bwd:2"])
def test_stop_policy_stops_on_any_oom_after_the_count_alone(fail):
    c = FakeCollective()
    eng = engine(c, policy=Policy.STOP)
    with pytest.raises(StopTraining):
        run_window(eng, FakeRank(eng, fail={fail}), batches())
    assert c.calls == [("sum",)]


@pytest.mark.parametrize("fail", ["fwd:1", "fwd:2", "bwd:2"])
def test_the_stopping_rank_leaves_its_reason_and_the_others_stop_with_it(fail):
    c = FakeCollective()
    eng = engine(c, policy=Policy.STOP)
    with pytest.raises(StopTraining) as stopped:
        run_window(eng, FakeRank(eng, fail={fail}), batches())
    assert c.announced == str(stopped.value)

    class PeerLeft(FakeRank):  # the other rank: its pending collective fails when the stopping rank exits
        def run_chunk(self, chunk, final):
            raise RuntimeError("Connection closed by peer (gloo)")

    for reason, expected in [(c.announced, StopTraining), (None, RuntimeError)]:
        other = FakeCollective()
        other.peer_reason = reason
        eng = engine(other, policy=Policy.STOP)
        with pytest.raises(expected) as raised:
            run_window(eng, PeerLeft(eng), batches())
        if reason is None:  # an error of its own: never relabelled
            assert "Connection closed" in str(raised.value)
        else:
            assert str(raised.value).startswith(reason + " on another rank")
            assert isinstance(raised.value.__cause__, RuntimeError)


def test_stop_policy_normal_window_two_collectives():
    c = FakeCollective()
    eng = engine(c, policy=Policy.STOP)
    rank = FakeRank(eng)
    run_window(eng, rank, batches())
    run_window(eng, rank, batches())
    assert c.calls == [("sum",), ("any_of", (False, False))] * 2


@pytest.mark.parametrize("fail", ["fwd:1", "fwd:2", "bwd:1", "bwd:2"])
def test_one_process_reruns_under_either_policy_without_collectives(fail):
    for policy in (Policy.RERUN, Policy.STOP):
        eng = engine(Local(), policy=policy)
        rank = FakeRank(eng, fail={fail})
        returned = run_window(eng, rank, batches())
        assert eng.cut_units == 2 and rank.sizes[-4:] == [2, 2, 2, 2]
        # what the loop accumulates equals the re-run window's loss: 4 chunks of 1.0
        assert float(sum(returned)) == pytest.approx(4.0)


def test_no_smaller_cut_raises_the_shrink_error():
    def shrink(units):
        raise RuntimeError("out of memory at micro-batch 1")

    eng = engine(Local(), shrink=shrink)
    with pytest.raises(RuntimeError, match="micro-batch 1"):
        run_window(eng, FakeRank(eng, fail={"fwd:1"}), batches())


def test_every_rank_makes_the_same_calls_whoever_fails():
    """Simulate both ranks: the sequence of collective kinds is identical on every path."""
    for fail0, fail1 in [((), ("fwd:1",)), (("fwd:2",), ()), ((), ())]:
        calls = []
        for mine, theirs in ((fail0, fail1), (fail1, fail0)):
            other_flags = _flags(theirs)
            c = FakeCollective(other_flags)
            eng = engine(c)
            run_window(eng, FakeRank(eng, fail=set(mine)), batches())
            calls.append([k[0] for k in c.calls])
        assert calls[0] == calls[1], (fail0, fail1)


def _flags(fail):
    # the other rank's answers at (before-final, after-final, re-run before-final, re-run after-final)
    if "fwd:1" in fail:
        return [True, False, False]
    if "fwd:2" in fail:
        return [False, True, False, False]
    return []


def test_non_finite_loss_on_one_rank_makes_every_rank_skip():
    c = FakeCollective(other_flags=[False, False, (True, False)])  # the other rank's window loss was NaN
    eng = engine(c)
    run_window(eng, FakeRank(eng), batches())
    assert eng.outcome.skip and not eng.outcome.stop


def test_a_stop_request_on_one_rank_stops_every_rank_after_the_same_step():
    c = FakeCollective(other_flags=[False, False, (False, True)])
    eng = engine(c)
    run_window(eng, FakeRank(eng), batches())
    assert eng.outcome.stop and not eng.outcome.skip
    eng.stop_requested = lambda: True  # this rank's own request, one process
    solo = engine(Local())
    solo.stop_requested = lambda: True
    rank = FakeRank(solo)
    run_window(solo, rank, batches())
    assert solo.outcome.stop


def test_nan_window_loss_is_reported_as_skip():
    eng = engine(Local())

    class NaNRank(FakeRank):
        def run_chunk(self, chunk, final):
            return super().run_chunk(chunk, final) * float("nan")

    run_window(eng, NaNRank(eng), batches())
    assert eng.outcome.skip
