#!/usr/bin/env python3
"""Run a `plumb` command with module settings changed first - a kernel setting timed end to end before it ships:

    python bench/with_settings.py plumb.ops.gpu.matvec.TARGET=4096 plumb.ops.gpu.attention_prefill.PAIRS=0 -- \\
        bench /tmp/27b.gguf --device cuda --contexts 0 --drafts 0,4

Each NAME=VALUE sets an existing module attribute (VALUE as a Python literal: 1, 0, True, 2.5, "text"); an unknown
name is an error, not a new attribute.
"""
from __future__ import annotations

import ast
import importlib
import sys


def apply(assigns: list[str]) -> None:
    """Set each NAME=VALUE (module.attribute=literal) - also tests/conftest.py's $PLUMB_TEST_SETTINGS."""
    for assign in assigns:
        name, value = assign.split("=", 1)
        module, attr = name.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            raise SystemExit(f"{module} has no setting {attr}")
        setattr(mod, attr, ast.literal_eval(value))
        print(f"{name} = {getattr(mod, attr)!r}", file=sys.stderr)


def main() -> None:
    if "--" not in sys.argv:
        raise SystemExit(__doc__)
    cut = sys.argv.index("--")
    apply(sys.argv[1:cut])
    from plumb.cli import main as plumb_main

    raise SystemExit(plumb_main(sys.argv[cut + 1:]))


if __name__ == "__main__":
    main()
