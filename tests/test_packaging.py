"""What a user installs holds all of hf_accum (issue 39): setuptools' discovery finds every package under hf_accum/
(a hand-written list once missed engines/ and levers/, and the wheel did not import), the recipe YAMLs ship as
package data, LICENSE ships in the wheel and the sdist, and the version has one source.

The cheap tests read pyproject.toml through setuptools' own reader (the packages it would build); the slow one
builds the sdist and, from it, the wheel, as `python -m build` does, and lists what they hold. CI also installs that
wheel outside the repository and runs it (ci/installed_wheel.sh, ci/test_installed.py)."""

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import hf_accum

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "hf_accum"


def source_modules() -> set[str]:
    """Every .py under hf_accum/, as the wheel names it."""
    return {p.relative_to(ROOT).as_posix() for p in SOURCE.rglob("*.py") if "__pycache__" not in p.parts}


def recipe_files() -> set[str]:
    return {f"hf_accum/recipes/yaml/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")}


def setuptools_config() -> dict:
    from setuptools.config.pyprojecttoml import read_configuration

    return read_configuration(ROOT / "pyproject.toml")  # expanded: the packages the build would find


def test_discovery_finds_every_package_under_hf_accum():
    packages = set(setuptools_config()["tool"]["setuptools"]["packages"])
    folders = {".".join(Path(m).parent.parts) for m in source_modules()}
    assert {"hf_accum.integrations.engines", "hf_accum.levers", "hf_accum.recipes"} <= folders  # the walk saw the subpackages
    assert folders <= packages, sorted(folders - packages)
    assert not any("__pycache__" in p for p in packages), packages


def test_the_recipes_and_py_typed_are_package_data():
    config = setuptools_config()["tool"]["setuptools"]
    assert "hf_accum.recipes.yaml" in config["packages"]
    assert config["package-data"]["hf_accum.recipes.yaml"] == ["*.yaml"]
    assert "py.typed" in config["package-data"]["hf_accum"]
    assert (SOURCE / "py.typed").is_file()
    assert len(recipe_files()) == 5  # lora_sft, qlora_sft, lora_classification, lora_dpo, lora_grpo
    # the package folder is recipes/ itself (a symlink), so a checkout finds the same files through it
    assert sorted(p.name for p in (SOURCE / "recipes" / "yaml").glob("*.yaml")) == sorted(
        p.name for p in (ROOT / "recipes").glob("*.yaml"))


def test_license_is_the_apache_text_and_named_for_the_distributions():
    project = setuptools_config()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150  # the full text, not a notice


def test_the_version_has_one_source():
    import tomllib

    raw = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in raw["project"] and "version" in raw["project"]["dynamic"]
    assert raw["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hf_accum.__version__"}
    assert setuptools_config()["project"]["version"] == hf_accum.__version__
    hits = [p for p in source_modules() if hf_accum.__version__ in (ROOT / p).read_text()]
    assert hits == ["hf_accum/__init__.py"], hits


@pytest.mark.slow
def test_the_sdist_and_the_wheel_built_from_it_hold_everything(tmp_path):
    build = ("import sys; from setuptools import build_meta as b; "
             "print(getattr(b, sys.argv[1])(sys.argv[2]))")
    run = subprocess.run([sys.executable, "-c", build, "build_sdist", str(tmp_path)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=600)
    sdist = tmp_path / run.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        assert not [m.name for m in tar.getmembers() if m.issym()]  # recipes/yaml as real files
        tar.extractall(tmp_path, filter="data")
    assert "LICENSE" in names and "pyproject.toml" in names
    assert source_modules() | recipe_files() <= names, sorted(source_modules() | recipe_files() - names)

    run = subprocess.run([sys.executable, "-c", build, "build_wheel", str(tmp_path)], cwd=tmp_path / top,
                         check=True, capture_output=True, text=True, timeout=600)
    wheel = zipfile.ZipFile(tmp_path / run.stdout.strip().splitlines()[-1])
    names = set(wheel.namelist())
    expected = source_modules() | recipe_files() | {"hf_accum/py.typed"}
    assert expected <= names, sorted(expected - names)
    (info,) = {n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA")}
    assert wheel.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    metadata = wheel.read(f"{info}/METADATA").decode()
    assert f"\nVersion: {hf_accum.__version__}\n" in metadata and "\nLicense-Expression: Apache-2.0\n" in metadata
