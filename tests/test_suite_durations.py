"""scripts/dev/suite_durations.py: the table of docs/development.md's "Where the suite's time goes" is read from
pytest's --durations=0 report, setup + call + teardown per test, summed per file."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "dev" / "suite_durations.py"
spec = importlib.util.spec_from_file_location("suite_durations", SCRIPT)
suite_durations = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_durations)

REPORT = """\
============================= slowest durations ==============================
40.10s setup    tests/recipes/test_recipes.py::test_a[lora_sft]
2.50s call     tests/recipes/test_recipes.py::test_a[lora_sft]
3.00s call     tests/recipes/test_recipes.py::test_b
0.40s teardown tests/test_args.py::test_c
(12 durations < 0.005s hidden.)
"""


def test_a_tests_phases_add_up_and_files_sum_their_tests():
    tests = suite_durations.parse(REPORT.splitlines())
    assert tests == {"tests/recipes/test_recipes.py::test_a[lora_sft]": 42.6,
                     "tests/recipes/test_recipes.py::test_b": 3.0, "tests/test_args.py::test_c": 0.4}
    assert suite_durations.per_file(tests) == {"tests/recipes/test_recipes.py": 45.6, "tests/test_args.py": 0.4}


def test_a_report_without_durations_is_refused(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("1 passed in 0.1s\n")
    assert suite_durations.main([str(log)]) == 2
    assert "no durations found (run pytest with --durations=0)" in capsys.readouterr().err
