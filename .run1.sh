set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "l2_cache or paired or gemv" 2>&1 | tail -3
time python3 benchmarks/gpu_suite.py --sections env,w4a16,kv --out $OUT/micro.json 2>&1 | grep -v "^{'shape'" | tail -30
time python3 benchmarks/gpu_kernel_sweeps.py --sections tiles,mha --out $OUT/sweeps.json 2>&1 | tail -12 | cut -c1-600
time python3 benchmarks/gpu_decode_reuse.py --reps 3 --out $OUT/reuse.json 2>&1 | tail -6
