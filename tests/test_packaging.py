"""The wheel holds every package of the tree: each folder with an __init__.py under a product folder is named in
pyproject's `packages` (setuptools skips one that is not, and a non-editable install then fails to import it), and
the shipped EAGLE head is package data."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_of_the_tree_is_in_the_wheel() -> None:
    config = _config()
    folders = {folder: name for name, folder in config["package-dir"].items()}
    found = set()
    for folder, name in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert sorted(found - set(config["packages"])) == []


def test_the_shipped_eagle_head_is_package_data() -> None:
    head = ROOT / "worker" / "spec" / "heads" / "smollm2-135m-instruct"
    patterns = _config()["package-data"]["tokenmill.worker.spec"]
    files = {p.name for p in head.iterdir()}
    assert {"model.safetensors", "eagle_config.json"} <= files
    assert all(any(Path("heads", head.name, f).match(p) for p in patterns) for f in files)


def test_the_tuned_kernel_config_tables_are_package_data() -> None:
    """kernels/configs/*.json ships in the wheel, and every table there parses and is named after its device."""
    from tokenmill.kernels import tuned

    assert "configs/*.json" in _config()["package-data"]["tokenmill.kernels"]
    assert tuned.CONFIG_DIR == ROOT / "kernels" / "configs" and tuned.CONFIG_DIR.is_dir()
    for path in tuned.CONFIG_DIR.glob("*.json"):
        table = tuned.load_table(path)
        assert path.name == f"{tuned.device_slug(table.device)}.json"
