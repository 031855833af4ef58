"""The package's layers import only downwards: _runtime -> kernels -> _ops -> ops -> optim -> dist.

Read from the source with ``ast`` (nothing is imported). ``_runtime``,
``_validation`` and ``_distributed`` are the base every layer may use; ``optim`` and ``dist`` reach
the kernels only through the public ``tritonopt.ops``; ``dist`` uses ``optim``'s
public modules and names only (it composes them, it does not reach inside).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tritonopt"
BASE = {"tritonopt._runtime", "tritonopt._validation", "tritonopt._distributed"}

# layer -> the tritonopt modules (prefixes) it may import, besides its own layer
ALLOWED = {
    "base": set(),
    "kernels": BASE,
    "_ops": BASE | {"tritonopt.kernels"},
    "ops": BASE | {"tritonopt._ops"},
    "optim": BASE | {"tritonopt.ops"},
    "dist": BASE | {"tritonopt.ops", "tritonopt.optim"},
    "root": BASE | {"tritonopt.ops", "tritonopt.optim", "tritonopt.dist"},
}


def layer_of(module: str) -> str:
    if module in BASE:
        return "base"
    if module == "tritonopt":
        return "root"
    part = module.split(".")[1]
    return {"kernels": "kernels", "_ops": "_ops", "ops": "ops", "optim": "optim", "dist": "dist"}[part]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every ``import tritonopt...`` / ``from tritonopt... import names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("tritonopt")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tritonopt"):
            found.append((node.module, [alias.name for alias in node.names]))
    return found


# Modules that still reach past a layer, with what they reach for (strict xfails until moved).
KNOWN_CROSSINGS: dict[str, str] = {}
MODULES = [
    pytest.param(path, id=module_name(path), marks=[pytest.mark.xfail(reason=KNOWN_CROSSINGS[module_name(path)], strict=True)]
                 if module_name(path) in KNOWN_CROSSINGS else [])
    for path in sorted(PACKAGE.rglob("*.py"))
]


@pytest.mark.parametrize("path", MODULES)
def test_imports_go_down_the_layers_only(path):
    name = module_name(path)
    layer = layer_of(name)
    own = f"tritonopt.{name.split('.')[1]}" if layer not in ("base", "root") else name
    for target, names in imports(path):
        if target == own or target.startswith(own + "."):
            continue
        allowed = ALLOWED[layer]
        assert any(target == a or target.startswith(a + ".") for a in allowed), (
            f"{name} ({layer} layer) imports {target}"
        )
        if layer == "dist" and target.startswith("tritonopt.optim"):
            private_module = any(part.startswith("_") for part in target.split(".")[2:])
            private_names = [n for n in names if n.startswith("_")]
            assert not private_module and not private_names, (
                f"{name} reaches inside optim: {target} {private_names or ''}"
            )
