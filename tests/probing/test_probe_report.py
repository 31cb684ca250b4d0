"""The probe's plot and output say what they show (issue 27, point 6): a chosen micro-batch the probe never ran is
marked as read off the fitted line, the budget's value and origin, the model and the sequence length are labelled,
kinds without points have no legend entry, and a default budget is named in the printed output."""

from hf_accum.probing.loop import ProbeResult, Trial
from hf_accum.probing.plan import Plan

MiB = 2**20


def result(*trials, fitted=(1.5 * MiB, 4.5 * MiB)):
    return ProbeResult(trials=list(trials), max_micro_batch_size=max(t.micro_batch_size for t in trials if t.fits),
                       fitted=fitted, budget_bytes=24 * MiB, capacity_bytes=1024 * MiB, max_micro_batch=32,
                       device="cpu")


def trial(micro, mib, fits=True):
    return Trial(micro, int(mib * MiB), None, 0.1, fits, "fits" if fits else "over budget")


def drawn(res, plan, **kw):
    import matplotlib.pyplot as plt

    from hf_accum.probing.report import plot

    fig = plot(res, plan, **kw)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    title = ax.get_title()
    plt.close(fig)
    return labels, title


def test_a_chosen_size_never_measured_is_marked_and_kinds_without_points_have_no_entry():
    labels, title = drawn(result(trial(1, 6.1), trial(5, 23.9)), Plan(4, 8, 1, 32), seq_len=256, model="tiny",
                          budget_source="the default for --model tiny")
    assert labels == ["measured: fits", "fitted a + b·micro", "budget 24.0 MiB (the default for --model tiny)",
                      "chosen micro 4 (not measured: on the fitted line)"]
    assert title == "tiny, seq 256\n" + Plan(4, 8, 1, 32).describe()


def test_a_measured_choice_and_an_over_budget_point():
    labels, title = drawn(result(trial(1, 6.1), trial(4, 19.5), trial(8, 37.0, fits=False)), Plan(4, 8, 1, 32),
                          seq_len=128, model="meta-llama/Llama-3.2-1B")
    assert labels == ["measured: fits", "measured: over budget", "fitted a + b·micro", "budget 24.0 MiB",
                      "chosen micro 4 (measured)"]
    assert title.startswith("meta-llama/Llama-3.2-1B, seq 128\n")


def test_the_default_budget_is_named_in_the_output(tmp_path, capsys):
    from hf_accum.cli import main

    assert main(["probe", "--seq-len", "32", "--target-batch", "4", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert ("budget: 24 MiB, the default for --model tiny: less than micro-batch 32 needs at seq 256, so the plan "
            "shows accumulation (set --budget or --budget-bytes for another)") in out
    assert "budget 24.0 MiB of " in out and "(the default for --model tiny)" in out
    assert (tmp_path / "p.png").stat().st_size > 0
    assert main(["probe", "--seq-len", "32", "--target-batch", "4", "--budget-bytes", str(30 * MiB)]) == 0
    out = capsys.readouterr().out
    assert f"budget: {30 * MiB} bytes (--budget-bytes)" in out and "default for --model tiny" not in out


def test_the_next_size_line_says_what_was_measured_and_what_a_usable_size_is():
    """Issue 59, item 15: "next usable size 6 does not fit (measured)" for a size never run, and "usable size"
    defined nowhere. Now the line names the size by what it would change (fewer forwards) and says which size was
    measured."""
    from hf_accum.probing.report import _next_size_line

    res = result(trial(1, 6), trial(4, 18), trial(5, 25, fits=False))
    res.next_size, res.next_verdict = 6, "measured"  # 5 failed, so 6 is known not to fit without being run
    assert _next_size_line(res) == ("the next size that would take fewer forwards, 6, does not fit (5, smaller, was "
                                    "measured not to)")
    res.trials.append(trial(6, 30, fits=False))
    res.trials.remove(res.trials[2])
    assert _next_size_line(res).endswith(", 6, does not fit (measured)")
    res.next_verdict = "predicted"
    assert _next_size_line(res).endswith(", 6, does not fit (predicted by the memory model)")
    res.next_verdict = "untried"
    assert _next_size_line(res).endswith(", 6, was not tried (the search stopped within its goal of the budget)")
