"""Shared pieces of the onnxruntime benchmarks: a mid-size random LLaVA, timing, result files."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def mid_llava(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
              image_size: int = 30, patch: int = 6, vision_hidden: int = 40, vision_layers: int = 2) -> Any:
    """A seeded random LlavaForConditionalGeneration (Llama decoder of the given size) with mmsdk's processor."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from mmsdk.core.sources import LoadedModel
    from mmsdk.models.family_processors import LlavaProcessor
    from mmsdk.models.tiny import TINY_WORDS
    from mmsdk.models.tokenizer import WordTokenizer

    tok = WordTokenizer.build(TINY_WORDS, ("<image>",))
    text = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                       pad_token_id=tok.pad_token_id)
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=vision_hidden * 4,
                              num_hidden_layers=vision_layers, num_attention_heads=max(1, vision_hidden // 64),
                              image_size=image_size, patch_size=patch, projection_dim=vision_hidden)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tok.token_id("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early, every run decodes N tokens
    return LoadedModel(model, LlavaProcessor(tok, image_size, patch), f"random llava (hidden {hidden}, {layers} layers)")


def best_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(fastest wall time, smallest process CPU time) of ``fn`` over ``repeats`` runs, after one warm-up.

    On a machine shared with other jobs the minimum is the least disturbed run; CPU time (all
    threads of this process) is what the work itself costs, whatever else runs.
    """
    fn()
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return wall, cpu


def decode_rate(run: Callable[[int], Any], tokens: int, repeats: int) -> dict[str, float]:
    """Decode tokens/s from the difference of generating ``tokens`` and 1 token (prefill cancels).

    ``decode_tokens_per_s`` uses wall time, ``decode_tokens_per_cpu_s`` process CPU time.
    """
    one_wall, one_cpu = best_seconds(lambda: run(1), repeats)
    many_wall, many_cpu = best_seconds(lambda: run(tokens), repeats)
    return {"prefill_plus_first_token_s": round(one_wall, 4), f"total_{tokens}_tokens_s": round(many_wall, 4),
            "decode_tokens_per_s": round((tokens - 1) / max(many_wall - one_wall, 1e-9), 2),
            "decode_tokens_per_cpu_s": round((tokens - 1) / max(many_cpu - one_cpu, 1e-9), 2)}


def environment() -> dict[str, Any]:
    """Machine and versions, for the record."""
    import onnxruntime
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
                "onnxruntime": onnxruntime.__version__}
    try:
        import onnxruntime_genai

        versions["onnxruntime_genai"] = onnxruntime_genai.__version__
    except ImportError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
            "logical_cores": len([line for line in Path("/proc/cpuinfo").read_text().splitlines()
                                  if line.startswith("processor")]),
            "versions": versions, "commit": commit, "command": " ".join([Path(sys.executable).name, *sys.argv])}


def write_results(name: str, results: dict[str, Any], table: str, markdown: Path | None) -> Path:
    """benchmarks/results/<name>.json, and the table appended to ``markdown`` with date, machine, versions, command."""
    out = ROOT / "benchmarks" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    if markdown is not None:
        env = results["environment"]
        versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
        block = (f"\n## {name} ({env['date_utc'][:10]})\n\nMachine: {env['cpu']}, {env['logical_cores']} logical cores. "
                 f"Versions: {versions}. Commit {env['commit']}.\n\nCommand: `{env['command']}`\n\n{table}\n")
        with open(markdown, "a") as handle:
            handle.write(block)
    return out


def rtn_int4(model: Any, adapter: Any, block: int) -> str:
    """Quantize the decoder's linears and the LM head to INT4: the int4-weight pass when installed, else RTN here."""
    import torch
    from torch import nn

    from mmsdk.core.session import Session

    session = Session.create(autoload=False)
    if "int4-weight" in session.passes:
        from mmsdk import Optimizer

        config = session.passes.get("int4-weight").config_cls(group_size=block, lm_head=True)
        Optimizer(model, session=session).apply(config).model  # noqa: B018 - runs the pass
        return f"int4-weight pass (rtn, group {block}, lm_head)"

    class Packed(nn.Module):  # MatMulNBits layout, symmetric, implicit zero point 8
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            w = linear.weight.detach().numpy()
            n, k = w.shape
            blocks = -(-k // block)
            padded = np.pad(w, ((0, 0), (0, blocks * block - k))).reshape(n, blocks, block)
            scale = np.maximum(np.abs(padded).max(-1), 1e-12) / 7.0
            q = (np.clip(np.rint(padded / scale[..., None]), -8, 7) + 8).astype(np.uint8)
            self.register_buffer("qweight", torch.from_numpy(q[..., 0::2] | (q[..., 1::2] << 4)))
            self.register_buffer("scales", torch.from_numpy(scale.astype(np.float32)))
            self.in_features, self.out_features, self.block_size, self.bias = k, n, block, None

        def packed(self) -> Any:
            from types import SimpleNamespace

            return SimpleNamespace(qweight=self.qweight, scales=self.scales, zero_points=None,
                                   in_features=self.in_features, block_size=self.block_size)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = torch.stack([self.qweight & 15, self.qweight >> 4], -1).flatten(-2).float() - 8
            w = (q * self.scales[..., None]).reshape(self.out_features, -1)[:, : self.in_features]
            return x @ w.T

    for parent in [*adapter.decoder_layers(model), model]:
        for owner in [m for m in parent.modules() if m is not model.model.vision_tower]:
            for name, child in list(owner.named_children()):
                if type(child) is nn.Linear and (parent is not model or name == "lm_head"):
                    setattr(owner, name, Packed(child))
    return f"RTN packer in this script (symmetric, group {block}, lm_head) - the int4-weight pass was not installed"
