"""Decode speed on CPU, same weights: torch fp32 eager, mmsdk's ONNX Runtime export (fp32 / INT4),
and the decoder ONNX Runtime GenAI's model builder writes for the same text weights (INT4, the peer).

    python benchmarks/ort_decode_speed.py [--tokens 64] [--markdown docs/benchmarks.md]

Decode tokens/s = (N - 1) / (time to generate N tokens - time to generate 1), medians of --repeats
runs, so prefill (and the vision stage) cancel. A benchmark, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import decode_rate, environment, mid_llava, rtn_int4, write_results  # noqa: E402

QUESTION = "what digit is this ?"
THREADS = 1  # ONNX Runtime intra-op threads and torch threads, the same for every engine (see --threads)
PAST = 64  # cached tokens in the graph-step measurement


def torch_rate(loaded: Any, image: Any, tokens: int, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(THREADS)
    inputs = loaded.processor(images=[image], text=[loaded.processor.format_prompt(QUESTION)])

    def run(n: int) -> None:
        with torch.no_grad():
            loaded.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return decode_rate(run, tokens, repeats)


def mmsdk_rate(loaded: Any, folder: Path, image: Any, tokens: int, repeats: int, **options: Any) -> dict[str, Any]:
    import mmsdk
    from mmsdk import Optimizer

    opt = Optimizer(loaded.model, loaded.processor)
    opt.export("onnxruntime", folder, overwrite=True, verify=False, **options)
    pipe = mmsdk.load(folder, intra_op_threads=THREADS)
    rate = decode_rate(lambda n: pipe.generate([image], [QUESTION], max_new_tokens=n), tokens, repeats)
    decoder, embedding = session(folder / "decoder.onnx", THREADS), session(folder / "embedding.onnx", THREADS)
    embed_feeds = {"input_ids": np.array([[5]], np.int64)}
    if any(i.name == "image_features" for i in embedding.get_inputs()):
        embed_feeds["image_features"] = np.zeros((0, decoder.get_inputs()[0].shape[-1]), np.float32)
    decoder_feeds = step_feeds(decoder, PAST)
    step = graph_step_ms([(embedding, embed_feeds), (decoder, decoder_feeds)], repeats * 3)
    alone = graph_step_ms([(decoder, decoder_feeds)], repeats * 3)
    return {**rate, "graph_step_ms": step, "decoder_step_ms": alone,
            "decoder_bytes": _bytes(folder, ("decoder.onnx", "decoder.onnx.data"))}


def builder_rate(loaded: Any, work: Path, tokens: int, repeats: int, prompt_len: int) -> dict[str, Any]:
    """The GenAI model builder's INT4 CPU decoder for the same text weights, run by onnxruntime-genai."""
    import onnxruntime_genai as og
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    text = loaded.model.config.text_config
    llm = LlamaForCausalLM(text).eval()
    with torch.no_grad():
        llm.model.load_state_dict(loaded.model.model.language_model.state_dict())
        llm.lm_head.weight.copy_(loaded.model.lm_head.weight)
    hf = work / "hf"
    llm.save_pretrained(hf)
    vocab = {f"t{i}": i for i in range(text.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0").save_pretrained(hf)
    out = work / "builder"
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", "llama", "-i", str(hf), "-o", str(out),
               "-p", "int4", "-e", "cpu"]
    subprocess.run(command, check=True, capture_output=True)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = THREADS
    config_path.write_text(json.dumps(config, indent=2))
    model = og.Model(str(out))
    prompt = np.random.RandomState(0).randint(3, text.vocab_size, prompt_len).astype(np.int32)

    def run(n: int) -> None:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt_len + n, min_length=prompt_len + n, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()

    rate = decode_rate(run, tokens, repeats)
    decoder = session(out / "model.onnx", THREADS)
    step = graph_step_ms([(decoder, step_feeds(decoder, PAST))], repeats * 3)
    return {**rate, "graph_step_ms": step, "decoder_step_ms": step, "decoder_bytes": _bytes(out, ("model.onnx", "model.onnx.data")),
            "builder_command": " ".join(["python", *command[1:]])}


def graph_step_ms(sessions: list[tuple[Any, dict[str, Any]]], repeats: int, steps: int = 30) -> float:
    """Smallest CPU time (ms) of one decode step through ``sessions`` (each run with its feeds)."""
    from benchmarks._common import best_seconds

    def run() -> None:
        for _ in range(steps):
            for session, feeds in sessions:
                session.run(None, feeds)

    return round(best_seconds(run, repeats)[1] / steps * 1e3, 3)


def step_feeds(decoder: Any, past: int) -> dict[str, Any]:
    """Random inputs of one decode step (batch 1, ``past`` cached tokens) for a decoder session."""
    rng = np.random.RandomState(0)
    feeds: dict[str, Any] = {}
    for inp in decoder.get_inputs():
        dims = [1 if d in ("batch_size", 1) else d for d in inp.shape]
        if inp.name == "input_ids":
            feeds[inp.name] = np.array([[5]], np.int64)
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((1, past + 1), np.int64)
        elif inp.name.startswith("past_key_values"):
            shape = [1, dims[1], past, dims[3] if isinstance(dims[3], int) else 64]
            feeds[inp.name] = rng.randn(*shape).astype(np.float32)
        else:  # inputs_embeds
            feeds[inp.name] = rng.randn(1, 1, dims[2]).astype(np.float32)
    return feeds


def session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _bytes(folder: Path, names: tuple[str, ...]) -> int:
    return sum((folder / n).stat().st_size for n in names if (folder / n).exists())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    global THREADS
    THREADS = args.threads

    from mmsdk.testing import sample_image

    loaded = mid_llava(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab)
    image = sample_image(0)
    prompt_len = int(loaded.processor(images=[image], text=[loaded.processor.format_prompt(QUESTION)])["input_ids"].shape[1])
    params = sum(p.numel() for p in loaded.model.model.language_model.parameters()) + loaded.model.lm_head.weight.numel()
    work = Path(tempfile.mkdtemp(prefix="mmsdk-bench-"))
    try:
        rows: dict[str, Any] = {"torch fp32 eager": torch_rate(loaded, image, args.tokens, args.repeats)}
        rows["mmsdk ORT fp32"] = mmsdk_rate(loaded, work / "fp32", image, args.tokens, args.repeats)
        peer = builder_rate(loaded, work, args.tokens, args.repeats, prompt_len)
        quantizer = rtn_int4(loaded.model, _adapter(loaded.model), args.block)
        for level in (4, 0):
            rows[f"mmsdk ORT INT4 (accuracy_level {level})"] = mmsdk_rate(
                loaded, work / f"int4_{level}", image, args.tokens, args.repeats, accuracy_level=level)
        rows["GenAI builder INT4 (accuracy_level 4)"] = peer
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {"environment": environment(), "model": {
        "decoder": f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, "
                   f"MLP {args.intermediate}, vocab {args.vocab}", "text_parameters": int(params),
        "prompt_tokens": prompt_len, "generated_tokens": args.tokens, "int4_quantizer": quantizer}, "rows": rows}
    header = ("| engine | decode tokens/s (wall) | decode tokens per CPU-second | decode step, embedding + decoder "
              "graphs (CPU ms) | decode step, decoder graph (CPU ms) | prefill + 1st token (s) | decoder file bytes |\n"
              "| --- | --- | --- | --- | --- | --- | --- |\n")
    table = header + "\n".join(f"| {name} | {r['decode_tokens_per_s']} | {r['decode_tokens_per_cpu_s']} | "
                               f"{r.get('graph_step_ms', '-')} | {r.get('decoder_step_ms', '-')} | "
                               f"{r['prefill_plus_first_token_s']} | {r.get('decoder_bytes', '-')} |"
                               for name, r in rows.items())
    table += (f"\n\nModel: {results['model']['decoder']} ({params / 1e6:.0f} M text parameters), prompt "
              f"{prompt_len} tokens, {args.tokens} generated; INT4: {quantizer}. Graph step: batch 1, {PAST} cached "
              f"tokens, mmsdk = embedding + decoder sessions, builder = its one model (embedding inside); "
              f"{THREADS} intra-op threads everywhere. Builder decoder bytes include its embedding table.")
    print(table)
    write_results("ort_decode_speed", results, table, args.markdown)


def _adapter(model: Any) -> Any:
    from mmsdk.core.session import Session

    return Session.create(autoload=False).adapt(model)


if __name__ == "__main__":
    main()
