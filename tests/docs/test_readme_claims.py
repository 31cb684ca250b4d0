"""README's and the manual's statements a new user acts on stay true: the transformers versions the quick start names
are the ones pyproject allows and CI installs, and both quick starts say what each shipped recipe needs beyond its
install."""

import os
import re

from hf_accum.recipes.config import wants_quantization
from hf_accum.recipes.files import available_recipes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*path):
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def test_the_supported_transformers_range_is_pyprojects_and_the_oldest_ci_pin():
    (spec,) = re.findall(r'"transformers(>=[\d.]+,<\d+)"', read("pyproject.toml"))
    low, high = re.match(r">=([\d.]+),<(\d+)", spec).groups()
    (oldest,) = re.findall(r"^transformers==([\d.]+?)(?:\.0)?$", read("ci", "oldest-constraints.txt"), re.M)
    (line,) = [ln for ln in read("docs", "quickstart.md").split("\n\n") if ln.startswith("Supported:")]
    line = " ".join(line.split())
    assert f"transformers >= {low}, < {high}" in line
    assert f"CI tests the oldest, {oldest}" in line and oldest == low
    for page in ["README.md", *(os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs")))]:
        if page.endswith(".md"):
            assert "5.17 – 5.23" not in read(page), page  # a closed range goes stale as pip resolves newer releases


def test_the_quick_start_says_what_a_quantized_recipe_adds():
    for quick in (read("README.md").split("## Quick start", 1)[1].split("\n## ", 1)[0],
                  read("docs", "quickstart.md").split("## A fresh machine", 1)[1].split("\n## ", 1)[0]):
        install = re.search(r'pip install -e "\.\[([a-z,]+)\]" && hf-accum train', quick).group(1).split(",")
        for name in available_recipes():
            if wants_quantization(name) and "qlora" not in install:
                assert name in quick and '".[recipes,qlora]"' in quick, f"{name}: the quick start must say to add qlora"
