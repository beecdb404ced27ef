# One 10-minute device call on one H200, from the repository root, with the megatron-core 0.19.2 cp312 wheel in .whl/
# and OUT set to a folder for what comes back. The whole GPU catalogue first (its figure is the one issue 23 asks
# for), then, with the time left, the fc1 sweep in workers with the oracle off and on.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
T0=$(date +%s); nvidia-smi -L; df -h /tmp | tail -1; nproc; free -g | head -2
python3 -c "import torch, megatron.core; print(torch.__version__, megatron.core.__version__)"
# every op-level GPU case of TP=1 at 11 token counts, one pool of workers, outputs dropped after each cell
mkdir -p /tmp/cat; start=$(date +%s)
timeout 480 python3 -m harness.commands.bench_speed --catalogue gpu --reports /tmp/cat --json $OUT/gpu_catalogue.json \
  > $OUT/gpu_catalogue.log 2>&1; echo "catalogue exit $? in $(( $(date +%s) - start )) s"
tail -3 $OUT/gpu_catalogue.log
(cd /tmp/cat && tar czf $OUT/gpu_catalogue_reports.tgz --exclude='*.safetensors' --exclude='*.log' \
  --exclude='request.json' */report.json */report.md 2>/dev/null)
# the fc1 sweep (8..64) with the oracle off, then on (bench_speed runs both; no single compare, no model level)
LEFT=$(( 570 - $(date +%s) + T0 )); echo "$LEFT s left for the sweeps"
[ $LEFT -gt 60 ] && timeout $LEFT python3 -m harness.commands.bench_speed --skip-compare --skip-model \
  --sweep-tokens 8,16,24,32,40,48,56,64 --sweep-args "--device gpu" --json $OUT/gpu_sweeps.json 2>&1 | tail -4
ls -la $OUT
