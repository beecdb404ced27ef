python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
T0=$(date +%s); nvidia-smi -L; df -h /tmp | tail -1; nproc
python3 -c "import torch, megatron.core; print(torch.__version__, megatron.core.__version__)"
T=8,16,24,32,40,48,56,64
# the fc1 sweep on the GPU: workers, then one process per cell (side by side), oracle off and on
timeout 100 python3 -m harness.commands.bench_speed --skip-compare --sweep-tokens $T --sweep-args "--device gpu --no-oracle" --json $OUT/gpu_sweep_workers.json 2>&1 | tail -4
timeout 140 python3 -m harness.commands.bench_speed --skip-compare --sweep-tokens $T --sweep-args "--device gpu --no-oracle --fresh-process" --json $OUT/gpu_sweep_fresh.json 2>&1 | tail -4
timeout 100 python3 -m harness.commands.bench_speed --skip-compare --sweep-tokens $T --sweep-args "--device gpu" --json $OUT/gpu_sweep_workers_oracle.json 2>&1 | tail -4
# the whole GPU catalogue (op level, TP=1 on one GPU) at 11 token counts, in one pool of workers
mkdir -p /tmp/cat; start=$(date +%s)
CATALOGUE_S=$(( 545 - $(date +%s) + T0 )); echo catalogue budget $CATALOGUE_S s; timeout $CATALOGUE_S python3 -m harness.commands.bench_speed --catalogue gpu --reports /tmp/cat --json $OUT/gpu_catalogue.json > $OUT/gpu_catalogue.log 2>&1; echo "catalogue exit $? in $(( $(date +%s) - start )) s"
tail -5 $OUT/gpu_catalogue.log
(cd /tmp/cat && tar czf $OUT/gpu_catalogue_reports.tgz --exclude='*.safetensors' --exclude='*.log' --exclude='request.json' --exclude='stdout.log' */report.json */report.md 2>/dev/null); ls -la $OUT
