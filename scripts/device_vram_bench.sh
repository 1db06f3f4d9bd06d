#!/usr/bin/env bash
# `kvlink bench transfer` with P's and D's KV in GPU memory (NIXL VRAM), then in host memory
# (NIXL DRAM) for comparison, on one GPU machine; the figures of BENCHMARKS.md, "GPU memory".
#
# Run from the repository root. With a .whl folder (wheels for that machine's python3, at
# least nixl-cu13 and msgspec) they are installed into /tmp/site first; kvlink itself runs
# from src/. Results: $OUT (default /tmp/kvlink-vram-out): one JSON per run, the UCX
# protocol tables D rank 0 logged. Environment: PY (python, default python3), TOKENS
# (default 512,4096,32768), RUN_TIMEOUT_S (per bench run, default 150), STAGES (default
# "check vram dram refuse"; "smoke" runs a tiny GPU-memory bench first and skips "vram"
# unless UCX chose cuda_ipc for its READs). UCX_* variables reach the peers unchanged,
# e.g. UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (UCX turns cuda_ipc GET off on a GPU without NVLink).
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-/tmp/kvlink-vram-out}
TOKENS=${TOKENS:-512,4096,32768}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}
STAGES=${STAGES:-check vram dram refuse}
mkdir -p "$OUT"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 3; }
    export PYTHONPATH=/tmp/site:$PWD/src
else
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
# UCX's CUDA memory module needs libcudart of the CUDA torch was built with.
CUDART=$($PY -c 'import glob, site; print(next(iter(sorted({p.rsplit("/", 1)[0] for d in site.getsitepackages()
             for p in glob.glob(d + "/nvidia/**/libcudart.so.*", recursive=True)})), ""))')
[ -n "$CUDART" ] && export LD_LIBRARY_PATH=$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

echo "=== machine: $(nproc) CPU cores, $(free -g | awk '/Mem:/ {print $2}') GiB; LD_LIBRARY_PATH+=${CUDART:-none}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
echo "=== UCX settings: $(env | grep ^UCX_ | tr '\n' ' ')"

bench() {  # NAME ARGS...: one bench run, its JSON, and the read protocols D rank 0 logged
    local name=$1; shift
    echo "=== bench $name: kvlink bench transfer --tokens $TOKENS $*"
    local t0=$SECONDS
    local tmp=/tmp/kvlink-device-runs/$name
    rm -rf "$tmp" && mkdir -p "$tmp"  # the bench's peer logs land in its own folder
    TMPDIR=$tmp timeout "$RUN_TIMEOUT_S" $PY -m kvlink.cli.main bench transfer --tokens "$TOKENS" \
        --json "$OUT/$name.json" "$@"
    local rc=$?
    echo "=== bench $name: exit $rc after $((SECONDS - t0)) s"
    local log
    log=$(ls -d "$tmp"/kvlink-bench-transfer-* 2>/dev/null | head -1)/benchD-r0.log
    [ -f "$log" ] && grep -A9 "remote memory read by ucp_get" "$log" | sed 's/^\(\[[^]]*\] *\)*//' \
        | grep "remote memory read\|^| *[0-9]" | awk '!seen[$0]++' > "$OUT/$name-ucx.txt" && cat "$OUT/$name-ucx.txt"
    [ "$rc" -ne 0 ] && [ -f "$log" ] && tail -40 "$log"
    return 0
}

SKIP_VRAM=0
for stage in $STAGES; do
    case $stage in
    check)
        echo "=== versions and a VRAM READ in one process (UCX_PROTO_INFO=y)"
        # Informative only (one process may use other UCX transports than two).
        UCX_PROTO_INFO=y timeout 90 $PY scripts/device_vram_check.py 2>&1 \
            | grep -v "^\[.*\] *+-\|^\[.*\] *| *Range" || echo "=== the VRAM check failed (exit ${PIPESTATUS[0]})" ;;
    smoke)
        bench vram-smoke --memory cuda --verify-kv off --preset smollm2-135m --tokens 32 --repeats 1 --min-seconds 0
        grep -q cuda_ipc "$OUT/vram-smoke-ucx.txt" 2>/dev/null \
            || { SKIP_VRAM=1; echo "=== UCX did not choose cuda_ipc for READs: no full GPU-memory run"; } ;;
    vram) [ "$SKIP_VRAM" = 1 ] || bench vram-off --memory cuda --verify-kv off ;;
    dram)
        bench dram-off --memory cpu --verify-kv off
        bench dram-sample --memory cpu ;;
    refuse)
        echo "=== the default check with GPU memory is refused:"
        $PY -m kvlink.cli.main bench transfer --memory cuda --verify-kv sample --tokens 32; echo "exit $?" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
