"""The README.md of a dual folder: what each half is and the commands that build and run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_readme"]


def write_readme(folder: Path, name: str, details: dict[str, Any], requirement: str) -> None:
    """Write ``folder/README.md``."""
    contract, llm = details["contract"], details["llm"]
    rows = contract["tokens_per_image"]
    if llm["target"] == "checkpoint":
        build = (f"trtllm-build --checkpoint_dir llm --output_dir llm-engine --max_batch_size 4 "
                 f"--max_multimodal_len {4 * (rows or 1)}\n")
        run = ("The host feeds `image_features` as TensorRT-LLM's prompt table: image placeholders become the ids "
               "vocab_size + i, `prompt_table` is the features in the LLM dtype, `tasks` is 0.")
    else:
        build = ""
        run = ("`LLM(model='llm')` loads the language model; each request passes the features as "
               "`{'prompt': text, 'multi_modal_embeddings': {'image': [features]}}`.")
    text = f"""# {name}: dual-path export (vision on ONNX Runtime, language model on TensorRT-LLM)

- `vision/vision.onnx`: vision tower + projector{' + token reduction' if contract['features']['slots_output'] else ''};
  output `image_features` {contract['features']['shape_per_image']} per image (float32). Runs in
  `onnxruntime>=1.30`.
- `llm/`: the language model for TensorRT-LLM (target `{llm['target']}`, weights {llm['weights']}, KV cache
  {llm['kv_cache_quant_algo'] or 'float'}); needs `{requirement}`.
- `calibration.json`: the one calibration both halves were quantized from; `manifest.json` holds the hand-off
  contract, the hashes of both halves and each runtime's version requirement.

Build (GPU machine with TensorRT-LLM):

```
{build}```

{run} Positions: `{contract['positions']}`.

Run on any machine (vision on ONNX Runtime, language model in TensorRT-LLM where installed, otherwise mmsdk's
CPU reference of the same files):

```
mmsdk run . --image digit.png --prompt "what digit is this ?"
```
"""
    (folder / "README.md").write_text(text)
