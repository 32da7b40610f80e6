"""A tuner's candidates compile side by side before they are timed (mmsdk.kernels.parallel_compile), checked without a
GPU: Triton's launch path runs against a stand-in driver that reports an H100 (sm_90), so each recorded kernel is
really compiled, with the ptxas Triton ships, and nothing is launched."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs Triton, not its interpreter")

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def doubled(x_ptr, y_ptr, n, BLOCK: tl.constexpr, FAIL: tl.constexpr = False):
        tl.static_assert(not FAIL, "this build was asked to fail")
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


class _H100Driver:
    """What Triton's launch path asks its driver before it compiles: an sm_90 target, device 0, a stream."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@pytest.fixture
def sm90(monkeypatch, tmp_path):
    """Triton's knobs, its launches pointed at an sm_90 stand-in, and an empty cache (so every kernel compiles)."""
    knobs = pytest.importorskip("triton.knobs", reason="Triton older than 3.4 has no compile hooks")
    from triton.runtime.driver import driver

    monkeypatch.setattr(driver, "_active", _H100Driver())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    return knobs


def _launches(blocks: tuple[int, ...], called: list[int] | None = None, fail: int | None = None):
    x, y = torch.randn(1000), torch.empty(1000)

    def launch(block: int) -> None:
        if called is not None:
            called.append(block)
        if block < 0:
            raise ValueError("a candidate whose launch fails before its kernel")
        doubled[(1,)](x, y, 1000, BLOCK=block, FAIL=block == fail)

    return [lambda b=b: launch(b) for b in blocks], (x, y)


def _compiles(knobs, block: int, args) -> int:
    """How many compiles a warm-up of ``BLOCK=block`` asks for (0 when the kernel is already kept)."""
    asked: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kwargs: asked.append(kwargs["repr"]) or None
    try:
        kernel = doubled.warmup(*args, 1000, BLOCK=block, grid=(1,))
    finally:
        knobs.runtime.jit_cache_hook = None
    assert "cubin" in kernel.asm
    return len(asked)


def test_each_kernel_the_launches_would_compile_is_compiled_once_on_threads_and_none_is_launched(sm90, caplog,
                                                                                                 monkeypatch):
    """Five launches over four tile sizes, one launch failing before its kernel: four kernels compile (on threads,
    for sm_90), none runs (a launch on the stand-in driver would fail), the hook is left unset, and the next launch of
    each compiles nothing. The compile step says what it compiled, on how many threads and in how long."""
    from mmsdk.kernels import parallel_compile
    from mmsdk.kernels.parallel_compile import compile_in_parallel

    monkeypatch.setattr(parallel_compile, "NOTED_SECONDS", 0.0)  # a compile this small may take less than the bar
    try:
        launches, args = _launches((64, 128, 256, 512, 64, -1))  # sizes no other test builds
        with caplog.at_level("DEBUG", logger="mmsdk.kernels"):  # DEBUG: a compile that failed says why
            assert compile_in_parallel(launches, threads=3) == 4
    except RuntimeError as error:  # no ptxas for this Triton build: nothing to check against
        if "ptxas" in str(error).lower():
            pytest.skip(f"Triton cannot compile for sm_90 here: {error}")
        raise
    assert sm90.runtime.jit_cache_hook is None
    assert re.search(r"compiled 4 kernels for a tuner on 3 threads in \d+\.\d s .*MMSDK_COMPILE_THREADS",
                     caplog.text), caplog.text
    assert [_compiles(sm90, block, args) for block in (64, 128, 256, 512)] == [0, 0, 0, 0], caplog.text
    assert _compiles(sm90, 32, args) == 1  # one no launch asked for compiles at its warm-up, as before


def test_each_compiled_kernels_launcher_is_built_on_the_compile_threads(sm90, monkeypatch):
    """After the compiles, each compiled kernel's C launcher is built on the same threads (Triton builds it at the
    kernel's first launch otherwise, one at a time); a launcher that fails to build is left to its launch."""
    import threading

    from triton.runtime.driver import driver

    from mmsdk.kernels.parallel_compile import compile_in_parallel

    built = []

    def launcher_cls(src, metadata):
        built.append((src.fn, metadata.num_warps, threading.current_thread().name))
        if len(built) == 1:
            raise RuntimeError("this launcher does not build")

    monkeypatch.setattr(driver._active, "launcher_cls", launcher_cls, raising=False)
    launches, _ = _launches((2048, 4096))  # sizes no other test builds
    assert compile_in_parallel(launches, threads=2) == 2
    assert len(built) == 2 and all(fn is doubled and warps > 0 for fn, warps, _ in built)
    assert all(thread.startswith("mmsdk-compile") for *_, thread in built)


@pytest.mark.skipif(shutil.which("gcc") is None or torch.cuda.is_available(),
                    reason="needs a C compiler, and a machine without a CUDA driver (a stand-in libcuda is loaded)")
def test_a_launcher_built_on_the_compile_threads_is_what_the_first_launch_finds_in_the_cache(sm90, monkeypatch,
                                                                                           tmp_path):
    """Triton's own CUDA launcher, built from what compile_in_parallel hands it, against a stand-in libcuda: the
    later build at the kernel's first launch finds the module in Triton's cache and compiles nothing."""
    import ctypes
    import inspect
    import subprocess
    import sys

    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime import build
    from triton.runtime.driver import driver

    from mmsdk.kernels import parallel_compile

    stub = tmp_path / "libcuda.so"
    (tmp_path / "stub.c").write_text("int mmsdk_stand_in_libcuda;\n")
    subprocess.check_call(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub),
                           str(tmp_path / "stub.c")])
    (tmp_path / "libcuda.so.1").symlink_to(stub)
    ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)  # the launcher module names libcuda.so.1: found by its soname
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path))
    compiles = []
    real_build = build._build
    monkeypatch.setattr(build, "_build", lambda *args: compiles.append(args[0]) or real_build(*args))
    monkeypatch.setattr(driver._active, "launcher_cls", CudaLauncher, raising=False)
    launches, args = _launches((8192, 16384))  # sizes no other test builds
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY)  # the launcher's CUDA calls resolve only when it launches
    try:
        assert parallel_compile.compile_in_parallel(launches, threads=2) == 2
        if "compile_module_from_src" not in inspect.getsource(CudaLauncher.__init__):
            assert compiles == []  # newer Triton launches every kernel through one module its driver builds
            return
        # Triton 3.6: a C module per argument signature, one for both kernels here, built on the threads (by both,
        # if they raced)
        assert compiles and set(compiles) == {"__triton_launcher"}
        built = len(compiles)
        for block in (8192, 16384):
            compiled = doubled.warmup(*args, 1000, BLOCK=block, grid=(1,))
            CudaLauncher(compiled.src, compiled.metadata)  # what the kernel's first launch builds
    finally:
        sys.setdlopenflags(flags)
    assert len(compiles) == built  # found in Triton's cache: nothing compiled at the launches


def test_a_kernel_that_fails_to_compile_is_left_to_fail_at_its_launch_and_its_error_is_logged(sm90, caplog):
    from mmsdk.kernels.parallel_compile import compile_in_parallel

    # sizes no other test builds: Triton keeps a process's kernels
    launches, args = _launches((16, 1024), fail=1024)
    with caplog.at_level("DEBUG", logger="mmsdk.kernels"):
        assert compile_in_parallel(launches, threads=2) == 2
    failed = [r.getMessage() for r in caplog.records if "on a compile thread failed" in r.getMessage()]
    assert len(failed) == 1 and "compiling doubled" in failed[0] and "asked to fail" in failed[0], caplog.text
    assert _compiles(sm90, 16, args) == 0
    with pytest.raises(Exception, match="asked to fail"):
        doubled.warmup(*args, 1000, BLOCK=1024, FAIL=True, grid=(1,))


def test_one_thread_one_launch_or_someone_elses_hook_leaves_compiling_to_the_launches(sm90, monkeypatch):
    from mmsdk.kernels.parallel_compile import COMPILE_THREADS_ENV, compile_in_parallel

    called: list[int] = []
    launches, _ = _launches((64, 128), called)
    assert compile_in_parallel(launches, threads=1) == 0
    assert compile_in_parallel(launches[:1], threads=4) == 0
    monkeypatch.setenv(COMPILE_THREADS_ENV, "1")
    assert compile_in_parallel(launches) == 0
    assert called == []  # not even recorded
    monkeypatch.delenv(COMPILE_THREADS_ENV)

    def theirs(**kwargs):
        return None

    sm90.runtime.jit_cache_hook = theirs
    assert compile_in_parallel(launches, threads=4) == 0 and called == []
    assert sm90.runtime.jit_cache_hook is theirs  # left to see every compile itself
    with pytest.raises(ValueError, match="warm_up='cold': use one of eager, captured"):
        compile_in_parallel(launches, threads=4, warm_up="cold")


def _stand_in_capture(monkeypatch, captures: list) -> None:
    """No GPU here: a "capture" that calls what it is handed (Triton skips each kernel not compiled, so nothing is
    launched), noting the stream it was asked for."""
    from mmsdk.kernels import parallel_compile

    def capture(fns, stream=None):
        captures.append(stream)
        for fn in fns:
            fn()

    monkeypatch.setattr(parallel_compile, "call_in_dropped_capture", capture)


def test_a_first_call_is_recorded_in_a_dropped_capture_and_its_kernels_compile_side_by_side(sm90, caplog,
                                                                                           monkeypatch):
    """compile_before_first_call runs the call once, inside a capture on the stream it is given; each kernel the call
    would compile is compiled on threads (for sm_90) and none is launched; the next launch of each compiles nothing,
    and the compile step's log line names what it compiled for."""
    from mmsdk.kernels import parallel_compile

    captures: list = []
    _stand_in_capture(monkeypatch, captures)
    monkeypatch.setattr(parallel_compile, "NOTED_SECONDS", 0.0)
    launches, args = _launches((2, 4, 2))  # sizes no other test builds
    runs = []

    def step() -> None:
        runs.append(1)
        for launch in launches:
            launch()

    with caplog.at_level("INFO", logger="mmsdk.kernels"):
        assert parallel_compile.compile_before_first_call(step, "the side stream", threads=2) == 2
    assert captures == ["the side stream"] and runs == [1]
    assert sm90.runtime.jit_cache_hook is None
    assert re.search(r"compiled 2 kernels for a first decode step on 2 threads in \d+\.\d s", caplog.text), caplog.text
    assert [_compiles(sm90, block, args) for block in (2, 4)] == [0, 0]


def test_a_first_call_that_fails_in_its_capture_keeps_what_it_recorded_before(sm90, monkeypatch):
    """A host sync in the call (which a capture refuses) ends the recording, not the caller: the kernels launched
    before it are compiled, and the real call meets the error itself."""
    from mmsdk.kernels.parallel_compile import compile_before_first_call

    _stand_in_capture(monkeypatch, [])
    launches, args = _launches((8,))  # a size no other test builds

    def step() -> None:
        launches[0]()
        raise RuntimeError("operation not permitted when stream is capturing")

    assert compile_before_first_call(step, None, threads=2) == 1
    assert _compiles(sm90, 8, args) == 0


def test_a_first_call_is_left_to_compile_its_own_kernels_on_one_thread_or_under_someone_elses_hook(sm90, monkeypatch):
    from mmsdk.kernels.parallel_compile import COMPILE_THREADS_ENV, compile_before_first_call

    captures: list = []
    _stand_in_capture(monkeypatch, captures)
    runs = []
    assert compile_before_first_call(lambda: runs.append(1), None, threads=1) == 0
    monkeypatch.setenv(COMPILE_THREADS_ENV, "1")
    assert compile_before_first_call(lambda: runs.append(1), None) == 0
    assert captures == [] and runs == []  # not even recorded
    monkeypatch.delenv(COMPILE_THREADS_ENV)

    def theirs(**kwargs):
        return None

    sm90.runtime.jit_cache_hook = theirs
    assert compile_before_first_call(lambda: runs.append(1), None, threads=4) == 0 and runs == []
    assert sm90.runtime.jit_cache_hook is theirs


def test_a_whole_decode_step_is_recorded_kernel_by_kernel_without_a_gpu_and_keeps_nothing_it_made():
    """What compile_before_first_call records of a real decode step: benchmarks/cpu_step_compiles.py runs each tiny
    family's step (qkv-fuse, int4-weight, rmsnorm-rope-fusion, int4-kv; IDEFICS with gated-xattn and int4-kv) on CPU as
    on sm_90 inside a capture, under the recording hook. The step runs to its end with every kernel skipped (the
    stand-in driver launches nothing), its GEMVs, attention and token choice are all recorded, and it leaves no tensor
    it made held by the model, the cache or the step (in the dropped capture such a tensor would never be written:
    the folded norms' factors were one, before Int4Linear stopped keeping factors made in a capture). With the tuner
    on, tiny LLaVA's step records every candidate of each GEMV shape as well, and keeps nothing either. In a process
    of its own: the benchmark patches mmsdk's device checks for good."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    child = """
import json
from benchmarks.cpu_step_compiles import record_step
from mmsdk.plugins.quantizers.int4_weight import Int4WeightConfig
stack = ["qkv-fuse", Int4WeightConfig(indivisible="pad"), "rmsnorm-rope-fusion", "int4-kv"]
found = {}
for model, passes in (("tiny:llava", stack), ("tiny:qwen2-vl", stack), ("tiny:mllama", stack),
                      ("tiny:idefics", ["gated-xattn", "int4-kv"])):
    record = record_step(model, passes)
    found[model] = {"kernels": [kernel.__name__ for kernel, _ in record.kernels.values()], "kept": record.kept}
record = record_step("tiny:llava", stack, tuner=True)
found["tiny:llava with the tuner"] = {"kernels": [k.__name__ for k, _ in record.kernels.values()], "kept": record.kept}
print(json.dumps(found))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", child], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode and "ptxas" in done.stderr.lower():
        pytest.skip("Triton cannot build for sm_90 here")
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    tuned = found.pop("tiny:llava with the tuner")  # every candidate of each GEMV shape recorded, nothing kept
    assert tuned["kept"] == [], tuned
    gemvs = [name for name in tuned["kernels"] if name.startswith("gemv")]
    assert len(gemvs) > 2 * sum(name.startswith("gemv") for name in found["tiny:llava"]["kernels"]), tuned
    assert set(found["tiny:llava"]["kernels"]) <= set(tuned["kernels"]), tuned
    for model, record in found.items():
        kernels = record["kernels"]
        assert record["kept"] == [], (model, record)
        assert "greedy_step" in kernels and "dequantize" not in kernels, (model, kernels)  # no whole layer read back
        if model != "tiny:idefics":
            assert kernels.count("gemv_quad") >= 4, (model, kernels)  # the GEMVs as untimed tuners launch them
            assert {"decode_partial", "decode_combine", "add_rms_norm"} <= set(kernels), (model, kernels)
        else:  # int4 MHA: one kernel that merges its own splits
            assert any(name.startswith("decode_partial") for name in kernels), (model, kernels)


def test_compiling_a_decode_step_ahead_is_asked_for_by_the_environment(monkeypatch):
    from mmsdk.kernels.parallel_compile import COMPILE_STEP_AHEAD_ENV, compile_step_ahead

    monkeypatch.delenv(COMPILE_STEP_AHEAD_ENV, raising=False)
    assert compile_step_ahead() is True
    for value, expected in (("1", True), ("0", False), ("", True)):
        monkeypatch.setenv(COMPILE_STEP_AHEAD_ENV, value)
        assert compile_step_ahead() is expected
    for bad in ("yes", "2", "on"):
        monkeypatch.setenv(COMPILE_STEP_AHEAD_ENV, bad)
        with pytest.raises(ValueError, match="MMSDK_COMPILE_STEP_AHEAD=.*set it to 1 .* or 0"):
            compile_step_ahead()


def test_compile_threads_come_from_the_environment_or_the_cpus(monkeypatch):
    from mmsdk.kernels.parallel_compile import COMPILE_THREADS_ENV, compile_threads

    monkeypatch.delenv(COMPILE_THREADS_ENV, raising=False)
    assert compile_threads() == min(len(os.sched_getaffinity(0)), 32)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    assert compile_threads() == 32  # a big host's CPUs are not all taken by default
    monkeypatch.setenv(COMPILE_THREADS_ENV, "3")
    assert compile_threads() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(COMPILE_THREADS_ENV, bad)
        with pytest.raises(ValueError, match="whole number of threads, 1 or more"):
            compile_threads()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("warm_up", ["captured", "eager"])  # in this order: Triton keeps a process's kernels, so the
# captured warm-up (the tuner's) compiles first, and the eager one then adds the other candidates' eager variants
def test_on_a_gpu_every_gemv_candidate_compiles_before_it_is_timed(monkeypatch, tmp_path, warm_up):
    """The one-row GEMV's candidates compiled side by side as a tuner runs them before timing, eagerly (each, or the
    first only under a captured warm-up) and inside a capture (where the GEMVs take programmatic dependent launch):
    launched afterwards that way, none compiles, and each captured one, replayed, gives the product of the
    dequantized weight. A captured warm-up records fewer kernels where the eager and captured variants differ."""
    from triton import knobs

    from mmsdk.kernels import captured_calls, pdl_ready
    from mmsdk.kernels.parallel_compile import compile_in_parallel
    from mmsdk.kernels.w4a16 import gemv_candidates, w4a16_gemv
    from mmsdk.plugins.quantizers.packing import dequantize_int4, quantize_int4

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    group = 32
    packed = quantize_int4(torch.randn(640, 1024, device="cuda") * 0.02, group, scale_dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(packed, torch.float32).T
    outputs: dict[tuple, torch.Tensor] = {}

    def launch(cfg: tuple) -> None:
        outputs[cfg] = w4a16_gemv(x, packed.qweight, packed.scales, packed.zero_points, group, config=cfg)

    launches = [lambda c=cfg: launch(c) for cfg in gemv_candidates(1, group)]
    recorded = compile_in_parallel(launches, threads=4, captured_on=x.device, warm_up=warm_up)
    asked: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kwargs: asked.append(kwargs["repr"]) or None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # as tuned_config runs them: its first eagerly, then graph_time_ms's warm-up
        launches[0]()
        graph, _ = captured_calls(launches, len(launches), stream, warm_up)
    torch.cuda.current_stream().wait_stream(stream)
    assert asked == []
    graph.replay()  # the captured (PDL) variants write the outputs the capture allocated
    torch.cuda.synchronize()
    for cfg, out in outputs.items():
        assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2, cfg
    if warm_up == "captured" and pdl_ready(x):  # one eager variant, not one per candidate
        assert recorded < 2 * len(set(gemv_candidates(1, group))), recorded
