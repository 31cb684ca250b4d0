"""Per-kind-of-batch exactness of the window engine (float64, CPU), printed as a table: the largest relative
gradient error over all optimizer steps against an independent reference (each sequence alone or one pass over
the window, cross-entropy by hand), clean and with an OOM injected inside a layer's forward mid-window.

    python benchmarks/bench_windows.py
"""

import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
logging.disable(logging.WARNING)

from tests import test_dpo, test_labels, test_padding_free  # noqa: E402


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("tokens", "samples"):
            t, rec, per_forward, _ = test_padding_free.run(os.path.join(tmp, f"pf-{mode}"), mode=mode)
            err = test_padding_free.max_error(rec, test_padding_free.reference_grads(rec, t.windows, mode))
            rows.append((f"padding-free ({mode})", "clean", sorted(set(per_forward)), err))
        t, rec, per_forward, _ = test_padding_free.run(os.path.join(tmp, "pf-oom"), oom_calls=(3,))
        err = test_padding_free.max_error(rec, test_padding_free.reference_grads(rec, t.windows, "tokens"))
        rows.append(("padding-free (tokens)", "OOM mid-window", sorted(set(per_forward[3:])), err))
        t, rec, seen, _ = test_dpo.dpo_run(os.path.join(tmp, "dpo"), 3, 2)
        rows.append(("DPO pairs (samples)", "clean", sorted({s // 2 for s in seen}),
                     test_dpo.max_error(rec, test_dpo.reference_grads(t, rec))))
        t, rec, seen, _ = test_dpo.dpo_run(os.path.join(tmp, "dpo-oom"), 4, 2, oom_calls=(3,), n=16)
        rows.append(("DPO pairs (samples)", "OOM mid-window", sorted({s // 2 for s in seen[3:]}),
                     test_dpo.max_error(rec, test_dpo.reference_grads(t, rec))))
        import copy

        from transformers.trainer_callback import PrinterCallback

        from hf_accum import AccumTrainer
        from tests.exactness import StepRecorder, recording, relative_error

        model = test_labels.tiny_segformer()
        initial = copy.deepcopy(model)
        rec = StepRecorder()
        trainer = recording(AccumTrainer)(model=model, args=test_labels.args_for(os.path.join(tmp, "seg"), 2, 3),
                                          train_dataset=test_labels.segmentation_data(),
                                          data_collator=test_labels.stack, callbacks=[rec])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        ref = test_labels.segmentation_reference(initial, rec, trainer.windows)
        rows.append(("SegFormer, ignore index 255", "clean", [2],
                     max(relative_error(g, r) for g, r in zip(rec.grads, ref))))
    print(f"{'batch kind':30} {'run':16} {'units per forward':18} max rel. grad error")
    for kind, run, units, err in rows:
        print(f"{kind:30} {run:16} {str(units):18} {err:.2e}")


if __name__ == "__main__":
    main()
