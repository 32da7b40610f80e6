"""Run Triton kernels on CPU with Triton's interpreter (``TRITON_INTERPRET=1`` must be set before import).

Triton 3.6's interpreter converts loop bounds with ``int(array)``, which NumPy >= 2.4 refuses for
1-element arrays; :func:`patch` makes it take ``.item()`` instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def patch() -> None:
    """Make Triton's interpreter work with NumPy >= 2.4 (no-op where it already does)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_mmsdk_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mmsdk_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def run_file(test_file: str, select: str) -> subprocess.CompletedProcess[str]:
    """``pytest -k select`` on ``test_file`` in a new process with ``TRITON_INTERPRET=1`` set from the start.

    The interpreter must be chosen before Triton compiles anything, so a test run that already
    imported Triton normally checks its kernels this way.
    """
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
