"""The installed wheel, tested from outside the repository (run by ci/installed_wheel.sh, never by the main pytest
run: tests/ is the main run's only test path). Each test fails when the package came from the source tree, or when
what was built or installed lacks a module, a recipe or the license.

Environment: HF_ACCUM_SOURCE (the repository) and HF_ACCUM_DIST (the folder holding the built wheel and sdist)."""

import importlib
import importlib.metadata
import os
import pkgutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import hf_accum

SOURCE = Path(os.environ["HF_ACCUM_SOURCE"]).resolve()
DIST = Path(os.environ["HF_ACCUM_DIST"]).resolve()
INSTALLED = Path(hf_accum.__file__).resolve().parent


def source_modules() -> set[str]:
    return {p.relative_to(SOURCE).as_posix() for p in (SOURCE / "hf_accum").rglob("*.py")
            if "__pycache__" not in p.parts}


def source_recipes() -> set[str]:
    return {f"hf_accum/recipes/yaml/{p.name}" for p in (SOURCE / "recipes").glob("*.yaml")}


def test_hf_accum_is_the_installed_copy_not_the_source_tree():
    assert not INSTALLED.is_relative_to(SOURCE), f"hf_accum imported from the source tree: {INSTALLED}"
    assert INSTALLED.is_relative_to(Path(sys.prefix).resolve()), (INSTALLED, sys.prefix)
    assert not Path.cwd().resolve().is_relative_to(SOURCE)  # run from outside the repository
    dist = importlib.metadata.distribution("hf-accum")
    assert dist.read_text("direct_url.json") is None or '"editable": true' not in dist.read_text("direct_url.json")


def test_every_module_imports():
    def reraise(name):  # walk_packages calls this inside the ImportError of a package it could not import
        raise

    names = [m.name for m in pkgutil.walk_packages(hf_accum.__path__, "hf_accum.", onerror=reraise)]
    assert {"hf_accum.integrations.engines.ddp", "hf_accum.levers.selective", "hf_accum.recipes.run"} <= set(names)
    expected = {m[: -len(".py")].replace("/", ".").removesuffix(".__init__") for m in source_modules()}
    assert expected <= set(names) | {"hf_accum"}, sorted(expected - set(names))
    for name in names:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(INSTALLED), (name, module.__file__)


def test_the_wheel_holds_every_module_the_recipes_and_the_license():
    (wheel,) = DIST.glob("hf_accum-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = source_modules() | source_recipes() | {"hf_accum/py.typed"}
    assert len(source_recipes()) == 5 and expected <= names, sorted(expected - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    installed = {str(f) for f in importlib.metadata.files("hf-accum")}  # what pip put in site-packages
    assert expected <= installed, sorted(expected - installed)


def test_the_sdist_holds_the_license_and_the_sources():
    (sdist,) = DIST.glob("hf_accum-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        license_text = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/LICENSE"))).read()
    assert "LICENSE" in names and license_text == (SOURCE / "LICENSE").read_bytes()
    assert source_modules() | source_recipes() <= names, sorted(source_modules() | source_recipes() - names)


def test_the_recipes_are_found_in_the_installed_package():
    from hf_accum.recipes.files import available_recipes, recipe_path

    assert available_recipes() == sorted(Path(r).stem for r in source_recipes())
    assert recipe_path("lora_sft").resolve().is_relative_to(INSTALLED)


@pytest.mark.parametrize("command", [[str(Path(sys.executable).parent / "hf-accum")], [sys.executable, "-m", "hf_accum.cli"]],
                         ids=["console-script", "module"])
def test_the_version_is_the_distributions(command):
    out = subprocess.run([*command, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"hf-accum {importlib.metadata.version('hf-accum')}"
    assert importlib.metadata.version("hf-accum") == hf_accum.__version__


def test_the_recipe_folder_named_to_a_user_is_the_installed_one():
    """`hf-accum train --help` and the unknown-recipe error name the folder that holds the recipes in this install
    (issue 59, item 13: both named the repository's recipes/, which a wheel install does not have)."""
    hf_accum_cli = str(Path(sys.executable).parent / "hf-accum")
    folder = str(INSTALLED / "recipes" / "yaml")
    helped = subprocess.run([hf_accum_cli, "train", "--help"], capture_output=True, text=True, check=True).stdout
    assert folder in " ".join(helped.split()) and "recipes/*.yaml" not in helped
    refused = subprocess.run([hf_accum_cli, "train", "nope"], capture_output=True, text=True)
    assert refused.returncode == 2 and f"the recipes are in {folder})" in refused.stderr
    assert (Path(folder) / "lora_sft.yaml").is_file()
