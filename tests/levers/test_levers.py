"""The checkpointing chooser (hf_accum/probing/level_choice.py), pure: tables of measured levels in, (rows, k) out."""

import math

import pytest

from hf_accum.probing.level_choice import CheckpointChooser, Level, fit_time_line, scale_line

MIB = 2**20


def synthetic(L=8, base=100 * MIB, act=10 * MIB, saved=1 * MIB, c=0.5, s=0.1, layer_fwd=0.004, buffer=True):
    """A model whose step memory and time follow the issue's expectation: every checkpointed layer frees
    ``act - saved`` per sample (the first k: the recompute buffer appears only when all are checkpointed) and adds
    one layer forward per sample to the step."""

    def memory(m, k):
        per_sample = L * act - k * (act - saved) + (act if k == L and buffer else 0)
        return base + m * per_sample

    def seconds(m, k):
        return c + m * (s + k * layer_fwd)

    return memory, seconds


def measured_level(memory, seconds, k, budget, cap):
    fits = [m for m in range(1, cap + 1) if memory(m, k) <= budget]
    largest = max(fits, default=0)
    failure = largest + 1 if largest < cap else None
    pts = [m for m in (max(1, largest - 1), largest) if m >= 1]
    line = None
    if largest >= 2:
        a = memory(pts[0], k)
        b = memory(pts[1], k) - a
        line = (a - b * pts[0], b)
    return Level(k, largest, failure, line, fit_time_line([(m, seconds(m, k)) for m in (1, max(1, largest))]))


def run_chooser(chooser, memory, budget, max_verifies=10):
    steps = 0
    while chooser.accepted is None:
        choice = chooser.propose()
        if choice is None:
            return None, steps
        if chooser.accepted is not None:
            break
        steps += 1
        assert steps <= max_verifies
        chooser.record(choice, memory(choice.micro, choice.k) <= budget)
    return chooser.accepted, steps


def exhaustive_best(memory, seconds, per_rank, L, budget):
    best = None
    for k in range(L + 1):
        for m in range(1, per_rank + 1):
            if memory(m, k) > budget:
                continue
            forwards = math.ceil(per_rank / m)
            rows = math.ceil(per_rank / forwards)
            t = forwards * seconds(rows, k)
            if best is None or t < best[0] - 1e-12:
                best = (t, rows, k)
    return best


@pytest.mark.parametrize("per_rank,budget_mib,L", [
    (32, 500, 8), (31, 500, 8), (64, 900, 8), (24, 300, 4), (40, 1000, 16), (32, 2000, 8), (7, 150, 2),
])
@pytest.mark.parametrize("buffer", [False, True])
def test_choice_is_the_exhaustive_best(per_rank, budget_mib, L, buffer):
    """Linear in k (no recompute buffer): the exact best. With the full level's recompute buffer, which the
    interpolation spreads over the partial levels (over-stating their memory), within the issue's 5%."""
    memory, seconds = synthetic(L=L, buffer=buffer)
    budget = budget_mib * MIB
    levels = [measured_level(memory, seconds, k, budget, per_rank) for k in (0, L)]
    chooser = CheckpointChooser(per_rank, L, budget, levels)
    got, steps = run_chooser(chooser, memory, budget)
    want = exhaustive_best(memory, seconds, per_rank, L, budget)
    assert got is not None and memory(got.micro, got.k) <= budget
    # near ties (3%) go to fewer checkpointed layers, on top of the interpolation's over-statement with the buffer
    assert forwards_time(seconds, per_rank, got) <= want[0] * (1.05 if buffer else 1) * (1 + chooser.tie_fraction)
    assert forwards_time(seconds, per_rank, got) >= want[0] - 1e-9
    assert steps <= 1  # the linear model is exact between the levels: at most one verifying step


def forwards_time(seconds, per_rank, choice):
    return choice.forwards * seconds(choice.micro, choice.k)


def test_whole_target_fits_without_checkpointing():
    memory, seconds = synthetic()
    budget = 10_000 * MIB
    level0 = measured_level(memory, seconds, 0, budget, 32)
    chooser = CheckpointChooser(32, 8, budget, [level0])
    choice = chooser.propose()
    assert (choice.micro, choice.k, choice.forwards, choice.verified) == (32, 0, 1, True)
    assert chooser.accepted == choice


def test_partial_level_chosen_and_verified_once():
    # no checkpointing fits 6 rows (6 forwards of 32), every layer 27 (2 forwards of 16); 7 of 8 layers also fit 16
    # rows, one layer's recompute less: the chooser takes the partial level and asks for one verifying step
    memory, seconds = synthetic(L=8, c=2.0, s=0.1, layer_fwd=0.004)
    budget = 600 * MIB
    levels = [measured_level(memory, seconds, k, budget, 32) for k in (0, 8)]
    assert levels[0].largest_fit == 6 and levels[1].largest_fit == 27
    chooser = CheckpointChooser(32, 8, budget, levels)
    first = chooser.propose()
    assert (first.k, first.micro, first.forwards, first.verified) == (7, 16, 2, False)
    assert first.predicted_seconds == pytest.approx(2 * seconds(16, 7))
    chooser.record(first, memory(first.micro, first.k) <= budget)
    assert chooser.accepted.k == 7 and chooser.accepted.verified


def test_back_off_after_a_failed_verification():
    memory, seconds = synthetic(L=8, c=2.0)
    budget = 500 * MIB
    levels = [measured_level(memory, seconds, k, budget, 32) for k in (0, 8)]
    chooser = CheckpointChooser(32, 8, budget, levels)
    first = chooser.propose()
    chooser.record(first, False)  # the device disagrees with the line
    second = chooser.propose()
    assert (second.k, second.micro) != (first.k, first.micro)
    assert chooser.max_micro(first.k) < first.micro
    # fallback: a measured point always remains
    for _ in range(40):
        choice = chooser.propose()
        if chooser.accepted is not None:
            break
        chooser.record(choice, False)
    assert chooser.accepted is not None and chooser.accepted.verified
    assert chooser.best_verified() is not None


def test_nothing_fits_even_with_every_layer_checkpointed():
    levels = [Level(0, 0, 1), Level(8, 0, 1)]
    assert CheckpointChooser(16, 8, 100 * MIB, levels).propose() is None


def test_nothing_fits_without_checkpointing_but_fits_with_it():
    memory, seconds = synthetic(L=4)
    budget = 130 * MIB
    levels = [measured_level(memory, seconds, k, budget, 16) for k in (0, 4)]
    assert levels[0].largest_fit == 0 and levels[1].largest_fit >= 1
    got, _ = run_chooser(CheckpointChooser(16, 4, budget, levels), memory, budget)
    assert got is not None and memory(got.micro, got.k) <= budget


def test_on_off_model_is_two_levels():
    # L = 1: checkpointing on or off. Off fits 3 rows (11 forwards for 32), on fits all 32 at +40% per sample
    levels = [Level(0, 3, 4, (100.0, 10.0), (1.0, 0.1)), Level(1, 32, None, (100.0, 2.0), (1.0, 0.14))]
    choice = CheckpointChooser(32, 1, 140.0, levels).propose()
    assert (choice.k, choice.micro, choice.forwards, choice.verified) == (1, 32, 1, True)
    # a large per-sample recompute cost with a tiny per-forward cost keeps it off
    levels = [Level(0, 3, 4, (100.0, 10.0), (0.001, 0.1)), Level(1, 32, None, (100.0, 2.0), (0.001, 0.5))]
    choice = CheckpointChooser(32, 1, 140.0, levels).propose()
    assert (choice.k, choice.micro, choice.forwards) == (0, 3, 11)


def test_cap_and_uneven_rows():
    levels = [Level(0, 7, 8, (0.0, 1.0), (1.0, 0.1))]
    choice = CheckpointChooser(31, 4, 7.5, levels).propose()
    assert (choice.micro, choice.forwards) == (7, 5)  # 31 rows in 5 forwards of at most 7 (7+6+6+6+6)
    levels = [Level(0, 20, None, (0.0, 1.0), (1.0, 0.1))]
    choice = CheckpointChooser(31, 4, 100.0, levels, cap=10).propose()
    assert (choice.micro, choice.forwards) == (8, 4)


def test_near_ties_go_to_fewer_checkpointed_layers():
    # every layer: 1 forward at 1.00 s; none: 2 forwards at 1.02 s in all, within the 3% tie: no checkpointing
    levels = [Level(0, 8, 9, (0.0, 2.0), (0.11, 0.05)), Level(4, 16, None, (0.0, 1.0), (0.2, 0.05))]
    choice = CheckpointChooser(16, 4, 16.0, levels).propose()
    assert (choice.k, choice.forwards) == (0, 2)
    choice = CheckpointChooser(16, 4, 16.0, levels, tie_fraction=0.0).propose()
    assert (choice.k, choice.forwards) == (4, 1)


def test_fit_time_line():
    assert fit_time_line([(1, 1.1), (5, 1.5), (5, 1.7)]) == pytest.approx((1.0, 0.1))
    assert fit_time_line([(4, 2.0)]) == (0.0, 0.5)
    assert fit_time_line([]) is None
    c, s = fit_time_line([(1, 1.0), (2, 0.9)])  # noise: flat
    assert s == 0.0
    assert scale_line((1.0, 0.1), 2.0) == pytest.approx((2.0, 0.2))


def test_bad_levels_refused():
    with pytest.raises(ValueError):
        CheckpointChooser(8, 4, 1.0, [])
    with pytest.raises(ValueError):
        CheckpointChooser(8, 4, 1.0, [Level(5, 1)])


def simulated_meter(memory, seconds, lever, overhead=1.25):
    from hf_accum.probing.meters import Measurement, Meter

    class SimulatedMeter(Meter):
        """The synthetic model's memory and time, read from the lever's level; the instrumented (measured) step
        runs ``overhead`` times slower than a plain (timed) one, as under a profiler. Counts both kinds of step."""

        name = "simulated"

        def __init__(self):
            self.measured, self.timed = [], []

        def measure(self, fn, *, micro_batch_size=None):
            fn()
            m, k = micro_batch_size, lever.k
            self.measured.append((m, k))
            factor = overhead(m, k) if callable(overhead) else overhead
            return Measurement(int(memory(m, k)), None, seconds(m, k) * factor)

        def time(self, fn, *, micro_batch_size=None):
            fn()
            self.timed.append((micro_batch_size, lever.k))
            return seconds(micro_batch_size, lever.k)

        def capacity_bytes(self):
            return 2**40

    return SimulatedMeter()


class SimulatedLever:  # levers.base.Levels: positions 0..count, the probe measures the anchors
    name = "checkpointing"

    def __init__(self, num_layers):
        self.num_layers, self.k = num_layers, 0
        self.count, self.anchors = num_layers, (0, num_layers)

    def record(self, k):
        return {"layers": k, "of": self.num_layers}

    def at(self, k):
        import contextlib

        @contextlib.contextmanager
        def level():
            saved, self.k = self.k, k
            try:
                yield
            finally:
                self.k = saved

        return level()


@pytest.mark.parametrize("budget_mib", [700, 1200])
def test_probe_levels_times_one_plain_step_and_levels_every_line_by_it(budget_mib):
    """Both ends are searched under the (slower) meter; one plain step, at the level whose largest fit holds the
    fewest rows, gives the ratio that brings every level's time line to plain seconds; the chosen point's seconds
    come from a plain step (reused when it is that one); the choice equals the exhaustive best of the true model."""
    from hf_accum.probing.levels import probe_levels

    L, per_rank = 8, 32
    memory, seconds = synthetic(L)
    lever = SimulatedLever(L)
    meter = simulated_meter(memory, seconds, lever)
    result = probe_levels(lambda micro: None, meter, budget_mib * MIB, per_rank, per_rank, lever)
    record = result.extra["checkpointing"]
    assert {k for _, k in meter.measured} >= {0, L}
    cheapest = min((lv["largest_fit"], lv["k"]) for lv in record["levels"] if lv["largest_fit"] >= 1)
    chosen = record["chosen"]
    plain = [(1, 0), cheapest]  # the warm-up step (optimizer state), then the one step that levels the lines
    if (chosen["micro"], chosen["k"]) != cheapest:
        plain.append((chosen["micro"], chosen["k"]))
    assert meter.timed == plain
    assert ("checked_against" in record) == (len(plain) == 3)
    for lv in record["levels"]:  # instrumented 1.25x slower: every line scaled back to the plain model's seconds
        c, s = lv["time"]
        assert c + s * lv["largest_fit"] == pytest.approx(seconds(lv["largest_fit"], lv["k"]))
    assert record["step_seconds"] == pytest.approx(chosen["forwards"] * seconds(chosen["micro"], chosen["k"]))
    best = min((math.ceil(per_rank / m) * seconds(math.ceil(per_rank / math.ceil(per_rank / m)), k), k)
               for k in range(L + 1) for m in range(1, per_rank + 1) if memory(m, k) <= budget_mib * MIB)
    assert chosen["forwards"] * seconds(chosen["micro"], chosen["k"]) <= best[0] * 1.03


def test_a_choice_the_plain_steps_refute_falls_back_to_the_measured_point():
    """An instrumented search that flatters the checkpointed level (here its steps read 2x faster than they run)
    predicts recompute pays; the plain step at the chosen point says otherwise, and the plainly timed level-0 point
    (its largest fit, measured to fit) is taken instead, with both figures recorded."""
    from hf_accum.probing.levels import probe_levels

    L, per_rank, budget = 8, 32, 1200 * MIB
    memory, seconds = synthetic(L, layer_fwd=0.02)  # recompute dear: level 0 is the true best
    lever = SimulatedLever(L)
    meter = simulated_meter(memory, seconds, lever, overhead=lambda m, k: 1.0 if k == 0 else 0.5)
    record = probe_levels(lambda micro: None, meter, budget, per_rank, per_rank, lever).extra["checkpointing"]
    fit0 = max(m for m in range(1, per_rank + 1) if memory(m, 0) <= budget)
    forwards = math.ceil(per_rank / fit0)
    assert record["checked_against"]["k"] == 0 and record["checked_against"]["micro"] == fit0
    assert record["chosen"]["k"] == 0 and record["chosen"]["forwards"] == forwards
    assert record["chosen"]["micro"] == math.ceil(per_rank / forwards) and record["chosen"]["verified"]
    assert record["step_seconds"] == pytest.approx(forwards * seconds(fit0, 0))
    assert len(meter.timed) == 3  # warm-up, level 0's plain step, the refuted choice's plain step
