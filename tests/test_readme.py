"""README's runnable examples run as written."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section_code(title: str) -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    body = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, re.S)
    assert blocks, f"no python block under '## {title}'"
    return blocks[0]


def test_the_plain_loop_example_runs(capsys):
    exec(compile(section_code("Your own training loop"), "README", "exec"), {})
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", capsys.readouterr().out)]
    assert len(losses) == 2  # 32 samples, 16 per optimizer step
    assert all(x == x and x > 0 for x in losses)


if __name__ == "__main__":
    pytest.main([__file__])
