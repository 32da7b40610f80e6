"""The README.md written into every TensorRT-LLM export: the exact build and run commands."""

from __future__ import annotations

from typing import Any

__all__ = ["checkpoint_readme", "hf_readme"]

_TRTEXEC_PRECISION = {"float16": "--fp16", "bfloat16": "--bf16", "float32": ""}
_GEMM = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


def checkpoint_readme(name: str, config: dict[str, Any], vision: dict[str, Any], requirement: str,
                      runner_note: str) -> str:
    """README for target A (trtllm-build checkpoint + vision ONNX)."""
    mapping, quant = config["mapping"], config["quantization"]
    world, dtype = mapping["world_size"], config["dtype"]
    model_type = vision["model_type"]
    fused_mlp = "" if quant.get("quant_algo") else " --use_fused_mlp=enable"
    mm_len = _multimodal_len(model_type, vision)
    launcher = f"mpirun -n {world} --allow-run-as-root " if world > 1 else ""
    lines = [
        f"# {name} for TensorRT-LLM (trtllm-build checkpoint)",
        "",
        f"Needs `{requirement}` (a release that still ships `trtllm-build`) and {world} GPU(s).",
        f"- `llm/`: TensorRT-LLM checkpoint, architecture `{config['architecture']}`, dtype `{dtype}`, "
        f"tp_size {mapping['tp_size']}, pp_size {mapping['pp_size']}, weights `{quant.get('quant_algo') or dtype}`, "
        f"KV cache `{quant.get('kv_cache_quant_algo') or dtype}`.",
        f"- `vision/`: vision tower + projector as ONNX (`model_type` `{model_type}`) and the runner's `config.json`.",
        "- `processor/`: config and processor files for `--hf_model_dir`.",
        "",
        "## 1. Language-model engine",
        "```bash",
        f"trtllm-build --checkpoint_dir llm --output_dir engines/llm --gemm_plugin {_GEMM[dtype]}{fused_mlp} \\",
        f"    --max_batch_size {vision['max_batch_size']} --max_input_len 2048 --max_seq_len 2560 "
        f"--max_multimodal_len {mm_len}",
        "```",
        "",
        "## 2. Vision engine",
        "```bash",
        "mkdir -p engines/vision && cp vision/config.json engines/vision/"
        + (" && cp vision/image_newlines.safetensors engines/vision/" if model_type == "llava_next" else ""),
        f"trtexec --onnx=vision/model.onnx {_TRTEXEC_PRECISION[dtype]} {_shapes(vision)} "
        "--saveEngine=engines/vision/model.engine",
        "```",
        "",
        "## 3. Run (from TensorRT-LLM's examples/models/core/multimodal)",
        "```bash",
        f"{launcher}python run.py --hf_model_dir processor --engine_dir engines --image_path image.png \\",
        '    --input_text "Describe the image."',
        "```",
        "",
        "Check the folder without TensorRT-LLM: `mmsdk validate .`; run it on the CPU with `mmsdk.load(folder)` "
        "(the reference loader).",
    ]
    if runner_note:
        lines += ["", f"Note: {runner_note}"]
    return "\n".join(lines) + "\n"


def _multimodal_len(model_type: str, vision: dict[str, Any]) -> int:
    if model_type == "llava":
        return int(vision["output_shape"][1]) * int(vision["max_batch_size"])
    return 4096  # LLaVA-NeXT and Qwen image token counts depend on the image size


def _shapes(vision: dict[str, Any]) -> str:
    inputs: dict[str, list[int]] = vision["inputs"]
    if "rotary_pos_emb" in inputs:  # dynamic patch count hw: from one merge unit to 5184 per image
        width, rot = inputs["input"][1], inputs["rotary_pos_emb"][1]
        sizes = {"min": 4, "opt": 1296, "max": 5184 * int(vision["max_batch_size"])}
        parts = []
        for kind, hw in sizes.items():
            shape = [f"input:{hw}x{width}", f"rotary_pos_emb:{hw}x{rot}", f"attention_mask:1x{hw}x{hw}"]
            if "window_attention_mask" in inputs:
                shape.append(f"window_attention_mask:1x{hw}x{hw}")
            parts.append(f"--{kind}Shapes=" + ",".join(shape))
        return " ".join(parts)
    _, c, h, w = inputs["input"]
    batch = int(vision["max_batch_size"])
    return " ".join(f"--{kind}Shapes=input:{b}x{c}x{h}x{w}"
                    for kind, b in (("min", 1), ("opt", max(1, batch // 2)), ("max", batch)))


def hf_readme(name: str, quant: dict[str, Any], requirement: str, model_type: str) -> str:
    """README for target B (Hugging Face folder for the PyTorch backend)."""
    details = quant.get("quantization", {})
    weights = details.get("quant_algo") or "unquantized"
    kv = details.get("kv_cache_quant_algo") or "model dtype"
    return "\n".join([
        f"# {name} for TensorRT-LLM (PyTorch backend)",
        "",
        f"Needs `{requirement}`. Weights: {weights}; KV cache: {kv}"
        + (" (hf_quant_config.json)." if details else "."),
        "",
        "## Serve",
        "```bash",
        "trtllm-serve . --host 0.0.0.0 --port 8000        # add --tp_size N for N GPUs",
        "```",
        "",
        "## Python",
        "```python",
        "from tensorrt_llm import LLM, SamplingParams",
        "from tensorrt_llm.inputs import default_multimodal_input_loader",
        "",
        'llm = LLM(model=".")',
        "inputs = default_multimodal_input_loader(",
        f'    tokenizer=llm.tokenizer, model_dir=".", model_type="{model_type}", modality="image",',
        '    prompts=["Describe the image."], media=["image.png"])',
        "print(llm.generate(inputs, SamplingParams(max_tokens=64))[0].outputs[0].text)",
        "```",
        "",
        "Check the folder without TensorRT-LLM: `mmsdk validate .`.",
    ]) + "\n"
