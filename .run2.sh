python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda and (split_k or gated or paired)" 2>&1 | tail -3
time python3 benchmarks/gpu_kernel_sweeps.py --sections tiles --out $OUT/tiles.json 2>&1 | tail -8 | cut -c1-400
time python3 benchmarks/gpu_decode_reuse.py --reps 3 --out $OUT/reuse.json 2>&1 | tail -3 | cut -c1-1500
