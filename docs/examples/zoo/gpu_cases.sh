# Sourced by the zoo's GPU scripts (qwen35_gpu.sh, qwen35_megatron_gpu.sh, dsa_gpu.sh). install_wheels puts the cp312
# wheels of .whl/ in /tmp/site, named by a .pth in the machine's interpreter that puts /tmp/site just ahead of that
# interpreter's own site-packages: ahead of whatever the machine's image installed there (a plain .pth line would come
# after it: the image's transformers then ran GLM-5's HF side, 2026-12-06), behind a named environment's own packages
# (PYTHONPATH would put transformers 5.3.0 ahead of the environment's 5.23.0). run_cases runs each case of $CASES, one
# at a time, keeps its console and report.md under $OUT, prints its verdict lines and whether it met its expectation,
# and returns 1 if any ended ERROR. DEVICE (default gpu) and TIMEOUT (seconds a side, default 1200) as the scripts set
# them; WHEELS (default .whl/*.whl) the wheels install_wheels puts in /tmp/site.
install_wheels() {
    # shellcheck disable=SC2086  # WHEELS: a list of paths (or the glob), split on purpose
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        ${WHEELS:-.whl/*.whl} || return 1
    local purelib
    purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || return 1
    echo "import sys; sys.path.insert(sys.path.index('$purelib') if '$purelib' in sys.path else len(sys.path), '/tmp/site')" \
        > "$purelib/zz-harness-site.pth" || return 1
    export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
}

run_cases() {
    local status=0 runs case start run
    runs=$(mktemp -d /tmp/zoo_runs.XXXXXX)
    for case in $CASES; do
        start=$(date +%s)
        python3 -m harness compare "$case" --device "${DEVICE:-gpu}" --no-oracle --timeout "${TIMEOUT:-1200}" \
            --reports "$runs/$case" > "$OUT/${case}_gpu.console.txt" 2>&1
        [ $? -eq 2 ] && status=1
        run=$(ls -td "$runs/$case"/*/ 2>/dev/null | head -1)
        [ -n "$run" ] && cp "$run/report.md" "$OUT/${case}_gpu.md"
        echo "== $case ($(( $(date +%s) - start )) s)"
        grep -E "^(BITWISE_PASS|DIFF|UNSUPPORTED|ERROR|WITHIN_TOLERANCE|TOLERANCE)|^expected|^step [0-9]" \
            "$OUT/${case}_gpu.console.txt" | tail -6
        rm -rf "${runs:?}/$case"
    done
    rm -rf "$runs"
    return $status
}
