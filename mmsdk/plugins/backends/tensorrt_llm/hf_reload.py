"""Reload a target-B folder through transformers: dequantize the W4A16_AWQ tensors and build the model.

The INT4 bytes are unpacked with the reference loader's own arithmetic, multiplied by their group
scales (and ``pre_quant_scale`` where present), and the result is loaded by the family's own
transformers class, so the comparison covers the tensor names, the packing and the norm folding.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from mmsdk.core.errors import ArtifactIntegrityError
from mmsdk.plugins.backends.tensorrt_llm.reference import unpack_int4

__all__ = ["dequantized_state", "load_hf_export"]


def dequantized_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(float32 state dict in checkpoint names, KV scales by tensor name) of a target-B folder."""
    import safetensors.torch

    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(safetensors.torch.load_file(str(path)))
    kv = {k: float(v) for k, v in state.items() if k.endswith(("k_proj.k_scale", "v_proj.v_scale"))}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key in kv or key.endswith(("weight_scale", "pre_quant_scale")):
            continue
        scale = state.get(key + "_scale") if key.endswith(".weight") else None
        if scale is None:
            out[key] = tensor.float()
            continue
        values = unpack_int4(tensor).float()
        weight = values * scale.float().repeat_interleave(values.shape[1] // scale.shape[1], dim=1)
        pre = state.get(key.removesuffix("weight") + "pre_quant_scale")
        out[key] = weight if pre is None else weight * pre.float()[None, :]
    return out, kv


def load_hf_export(folder: str | Path) -> Any:
    """The float32 transformers model a target-B folder describes (eval mode)."""
    import safetensors.torch
    import transformers

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    cls = next((getattr(transformers, a) for a in config.get("architectures", []) if hasattr(transformers, a)), None)
    if cls is None:
        raise ArtifactIntegrityError(
            f"{folder}/config.json names {config.get('architectures')}, unknown to transformers "
            f"{transformers.__version__}.",
            fix="load it with the transformers version recorded in manifest.json.",
        )
    state, _ = dequantized_state(folder)
    config.pop("quantization_config", None)
    config["dtype"] = config["torch_dtype"] = "float32"
    scratch = Path(tempfile.mkdtemp(prefix="mmsdk-hf-reload-"))
    try:
        (scratch / "config.json").write_text(json.dumps(config))
        safetensors.torch.save_file(state, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        return cls.from_pretrained(scratch, dtype=torch.float32).eval()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
