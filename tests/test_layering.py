"""The package layering (DESIGN.md, "Layout and imports"), read from the source files themselves.

protocol <- client <- gateway;  protocol <- broker;  protocol <- worker -> kernels;  cli -> everything.
Static tools resolve `tokenmill.X` through the editable install's mapping, so this test parses every file
with `ast` instead: an import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "client", "broker", "worker", "kernels", "gateway", "cli", "benchmarks")

# package -> (project packages it may import, third-party top-level modules it must not import)
ALLOWED: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "protocol": (frozenset(), frozenset({"torch", "numpy", "triton"})),
    "client": (frozenset({"protocol"}), frozenset({"torch", "numpy", "triton"})),
    "broker": (frozenset({"protocol"}), frozenset({"torch", "numpy", "triton"})),
    "gateway": (frozenset({"protocol", "client"}), frozenset({"torch", "numpy", "triton"})),
    "kernels": (frozenset(), frozenset()),
    "worker": (frozenset({"protocol", "kernels"}), frozenset()),
    "cli": (frozenset(PACKAGES), frozenset()),
    "benchmarks": (frozenset(PACKAGES), frozenset()),
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Every absolute module name a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel_parts = path.relative_to(ROOT).with_suffix("").parts  # ("worker", "models", "llama")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y, inside tokenmill.<package>...
                base = ["tokenmill", *rel_parts[: len(rel_parts) - node.level]]
                names.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                names.add(node.module)
    return names


def violations(package: str) -> list[str]:
    may_import, forbidden_libs = ALLOWED[package]
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for mod in imported_modules(path, package):
            parts = mod.split(".")
            if parts[0] == "tokenmill" and len(parts) > 1:
                target = parts[1]
                if target != package and target not in may_import:
                    found.append(f"{path.relative_to(ROOT)} imports {mod}")
            elif parts[0] in forbidden_libs:
                found.append(f"{path.relative_to(ROOT)} imports {mod}")
    return found


@pytest.mark.parametrize("package", [p for p in PACKAGES if (ROOT / p).is_dir()])
def test_import_direction(package: str) -> None:
    assert violations(package) == []


def test_rules_catch_a_violation(tmp_path: Path) -> None:
    """The checker itself: a broker file importing the worker, or torch, is reported."""
    bad = ROOT / "broker" / "_layering_probe.py"
    bad.write_text("def f():\n    import torch\n    from tokenmill.worker import engine\n    from ..client import x\n")
    try:
        found = violations("broker")
    finally:
        bad.unlink()
    assert any("imports torch" in v for v in found)
    assert any("tokenmill.worker" in v for v in found)
    assert any("tokenmill.client" in v for v in found)


def test_sdk_broker_and_protocol_load_no_torch() -> None:
    """What the import statements cannot show: nothing pulls torch or numpy in transitively, and importing
    the protocol alone does not load the client (nor zmq.asyncio)."""
    code = (
        "import sys\n"
        "import tokenmill.protocol, tokenmill.protocol.wire, tokenmill.protocol.keys\n"
        "assert 'tokenmill.client' not in sys.modules and 'zmq.asyncio' not in sys.modules, sorted(sys.modules)\n"
        "import tokenmill.client, tokenmill.client.async_client, tokenmill.client.remote_cli\n"
        "import tokenmill.broker, tokenmill.broker.broker\n"
        "import tokenmill.cli.serve, tokenmill.cli.gateway_cmds\n"
        "import tokenmill.gateway, tokenmill.gateway.app, tokenmill.gateway.server\n"
        "bad = [m for m in ('torch', 'numpy', 'tokenmill.worker') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
