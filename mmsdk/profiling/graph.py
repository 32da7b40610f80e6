"""The model's module tree as a Graphviz DOT graph, each module coloured by its bytes.

The .dot file is always written; an .svg is rendered beside it when Graphviz's ``dot`` program is
on PATH. A node's bytes are its weights (its whole subtree) plus the most working memory one call
of it needed; modules deeper than ``max_depth`` are folded into their ancestor.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from mmsdk.core.memory import format_bytes

if TYPE_CHECKING:
    from mmsdk.profiling.results import ModuleMemory, RunMemory

__all__ = ["GRAPH_FILE", "module_dot", "write_graph"]

GRAPH_FILE = "modules.dot"
_LEVELS = 9  # Graphviz's sequential "reds9" colour scheme


def _depth(name: str) -> int:
    return 0 if name == "(model)" else name.count(".") + 1


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else "(model)"


def _quote(text: str) -> str:
    return '"' + text.replace('"', '\\"') + '"'


def _level(value: int, largest: int) -> int:
    # Square root spreads the small modules over the palette instead of leaving them all white.
    return 1 + min(_LEVELS - 1, int((_LEVELS - 1) * (value / largest) ** 0.5)) if largest else 1


def module_dot(run: RunMemory, *, max_depth: int = 5) -> str:
    """DOT text of ``run``'s module tree down to ``max_depth`` levels below the model."""
    shown = [m for m in run.modules if _depth(m.name) <= max_depth]
    largest = max((m.total_bytes for m in shown if m.name != "(model)"), default=0)
    lines = [
        f"digraph {_quote(run.label)} {{",
        "  rankdir=LR; node [shape=box, style=filled, colorscheme=reds9, fontname=Helvetica, fontsize=10];",
        f"  label={_quote(f'{run.label}: weights + peak working memory per module')}; labelloc=t;",
    ]
    for module in shown:
        level = _level(module.total_bytes, largest)
        font = "white" if level >= 7 else "black"
        lines.append(f"  {_quote(module.name)} [label={_quote(_label(module))}, fillcolor={level}, fontcolor={font}];")
    for module in shown:
        if module.name != "(model)":
            lines.append(f"  {_quote(_parent(module.name))} -> {_quote(module.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _label(module: ModuleMemory) -> str:
    short = module.name.rsplit(".", 1)[-1]
    return (f"{short}\\n{module.kind}\\nweights {format_bytes(module.weights_bytes)}\\n"
            f"working {format_bytes(module.activation_peak_bytes)}")


def write_graph(run: RunMemory, folder: Path, *, max_depth: int = 5) -> list[Path]:
    """Write modules.dot (and modules.svg when Graphviz is installed); returns the paths written."""
    dot_path = folder / GRAPH_FILE
    dot_path.write_text(module_dot(run, max_depth=max_depth))
    dot = shutil.which("dot")
    if dot is None:
        return [dot_path]
    svg_path = dot_path.with_suffix(".svg")
    result = subprocess.run([dot, "-Tsvg", str(dot_path), "-o", str(svg_path)], capture_output=True, timeout=120)
    return [dot_path, svg_path] if result.returncode == 0 and svg_path.is_file() else [dot_path]
