python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_int4_weight.py tests/test_fast_generate.py -k "cuda or residual or fast" 2>&1 | tail -4
time python3 benchmarks/gpu_decode_reuse.py --reps 3 --out $OUT/reuse.json 2>&1 | tail -2 | cut -c1-700
time python3 benchmarks/gpu_suite.py --sections env,compiled --out $OUT/compiled.json 2>&1 | grep -E "variant|done" | cut -c1-300
