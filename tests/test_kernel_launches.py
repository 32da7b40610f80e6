"""Every Triton kernel launch in mmsdk asks for FP fusion (``a * b + c`` as one FMA) explicitly.

The kernels were written, checked and timed with fused multiply-adds (the subnormal-nibble arithmetic of the int4
KV and GEMV kernels, the scaling in every epilogue). Triton up to 3.9 fuses by default, and 3.9 warns that 3.10 will
not; a launch that left it to the default would then compile other instructions, with other roundings, than the
ones measured. Read from the source, so it needs neither Triton nor a GPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mmsdk"


def _jit_kernel_names() -> set[str]:
    """Names of the functions decorated with ``triton.jit`` anywhere in mmsdk (kernels and device helpers)."""
    names = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
                names.add(node.name)
    return names


def _launches() -> list[tuple[str, int, ast.Call]]:
    """``kernel[grid](...)`` calls of a ``triton.jit`` function: (file, line, call)."""
    kernels = _jit_kernel_names()
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            launched = node.func.value
            name = launched.attr if isinstance(launched, ast.Attribute) else getattr(launched, "id", None)
            if name in kernels:
                found.append((str(path.relative_to(ROOT.parent)), node.lineno, node))
    return found


def test_every_kernel_launch_asks_for_fp_fusion():
    launches = _launches()
    assert len(launches) >= 25, f"found only {len(launches)} kernel launches: the scan no longer sees them"
    missing = [f"{path}:{line}" for path, line, call in launches
               if not any(k.arg == "enable_fp_fusion" and isinstance(k.value, ast.Constant) and k.value.value is True
                          for k in call.keywords)]
    assert not missing, f"pass enable_fp_fusion=True to these launches: {missing}"
