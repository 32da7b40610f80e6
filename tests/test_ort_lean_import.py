"""Registering the onnxruntime backend imports neither onnxruntime nor onnx."""

from __future__ import annotations

import subprocess
import sys


def test_import_and_session_do_not_import_onnxruntime():
    code = ("import sys, mmsdk; s = mmsdk.Session.create(autoload=False); assert 'onnxruntime' in s.backends; "
            "import mmsdk.runtime; bad = [m for m in ('onnxruntime', 'onnx', 'onnxscript') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
