#!/bin/bash
# Every check that needs a GPU, for a machine lent for a few minutes:
#   overhead:  per-call time against torch's nccl, with a profile of where smddp's time goes,
#              and the overhead benchmark in nccl-tests format (issue 3's criterion)
#   tests:     the GPU tests (python -m pytest -m gpu; the collective sweep of tests/sweep.py on
#              CUDA tensors over NCCL and through host staging among them), and the Triton
#              kernels against their references on the GPU (tests/test_kernels.py)
#   optimizer: the optimizer-step benchmark against the fair baselines, the CUDA-graphed one
#              among them (issue 40's criterion), one parameter count at a time
#              (adam_kernel_sweep.py, run by hand, splits the step)
#   quantize:  the 8-bit wire's quantize and dequantize_add kernels against a same-size copy_
#              (quantize_kernels.py), checked against their reference as they are timed
#   train:     one training step end to end, DDP on nccl and on smddp and smddp_lite.compile
#   compiled:  GPT-2 small, smddp_lite.compile with torch_compile on and off against
#              torch.compile(DDP(model)) with fused AdamW on nccl and on smddp, with peak memory
# Each step has its own time limit, so one that hangs or runs long costs only its own share, and
# everything it printed is kept. Usage, from the repository root on the GPU machine:
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [--install] [overhead] [tests] [optimizer] [quantize] [train] [compiled]
#
# The parts run in the order named; with none named, all six, in that order. Their time limits
# add up to 3, 4 (6.5 with reruns of failed tests), 5.5, 1.5, 2.5 and 5 minutes: 24 in all, more
# than one 10-minute command may run, so where a hang must not cost the rest, run them in three
# calls, `overhead tests` (at most 9.5 minutes), `optimizer quantize train` (at most 9.5) and
# `compiled` (at most 5). Their real times are far below the limits: on an H100 (2026-11-28) `overhead tests
# train` took 153 s in one call; on 2026-11-27 the optimizer benchmark at 1B without
# torch.compile took 50 s, without the graphed baseline, which holds a fifth copy of the
# parameters, gradients and state (20 GB more at 1B: on a card of 80 GB give the 1B step
# --no-graphed). The tests run side by side where pytest-xdist is installed.
# The exit status is the number of steps that failed.
# --install first runs `pip install --no-deps --no-build-isolation -e .` (for an image that has
# torch, cupy and triton but not this package). Record what it measured in benchmarks/results/.
set -u
usage="usage: bash benchmarks/gpu_checks.sh OUT_DIR [--install] [overhead] [tests] [optimizer] [quantize] [train] [compiled]"
out=${1:?$usage}
shift
install=0 parts=""
for arg in "$@"; do
    case $arg in
        --install) install=1 ;;
        tests|overhead|optimizer|quantize|train|compiled) parts="$parts $arg" ;;
        *) echo "unknown argument '$arg'; $usage" >&2; exit 2 ;;
    esac
done
parts=${parts:-" overhead tests optimizer quantize train compiled"}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, output to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] && echo ' (time limit)')"
    [ $rc = 0 ] || failed=$((failed + 1))
    tail -n 3 "$out/$name.log"
}

if [ $install = 1 ]; then
    $py -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $py -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    $py -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version())" \
        || echo "no cupy: CUDA tensors will be staged through host memory"
    $py -c "import triton; print('triton', triton.__version__)" || echo "no triton"
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"

run_overhead() {
    # issue 40's criterion: p50 over 4000 calls of 256 B, blocking and async_op=True + wait()
    step call-latency 90 $py -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/latency.py \
        --device cuda --backends smddp,nccl --op all_reduce,all_gather --modes sync,async --calls 4000 \
        --profile "$out/smddp-call-profile.txt"
    # and from 64 MiB up, within 3% of nccl
    step overhead 90 $py -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/collectives.py \
        --device cuda --backends smddp,nccl --ops all_reduce,all_gather -b 64M -e 256M -n 100 \
        --json "$out/overhead.json"
}
run_tests() {
    # Each GPU test runs its own job of 1-3 ranks on the one GPU, so with pytest-xdist they run
    # side by side (71 took 205 s with 6 workers on an H200; 50 took 245 s one after another on
    # an H100), and the Triton kernels' tests run beside them. A test that fails then is run
    # again alone, as a timing test can miss its bound on a loaded machine, and the log then shows
    # both results. Conformance tests are not: their checks do not time anything, and each runs a
    # whole conformance job (14 of them alone took over 150 s).
    local workers=()
    $py -c "import xdist" 2>/dev/null && workers=(-n 6)
    timeout 240 $py -m pytest -q -p no:cacheprovider tests/test_kernels.py ${workers:+-n 2} >"$out/kernel-tests.log" 2>&1 &
    local kernels=$!
    step gpu-tests 240 $py -m pytest -m gpu -q -p no:cacheprovider -ra "${workers[@]}"
    wait $kernels
    local kernels_rc=$?
    echo "== kernel-tests: exit $kernels_rc"; tail -n 3 "$out/kernel-tests.log"
    [ $kernels_rc = 0 ] || failed=$((failed + 1))
    local again
    again=$(grep -o '^FAILED [^ ]*' "$out/gpu-tests.log" | cut -d' ' -f2 | grep -v '^tests/test_conformance.py')
    if [ -n "$again" ] && [ ${#workers[@]} -gt 0 ]; then
        # shellcheck disable=SC2086  # one node id per word
        step gpu-tests-failed-alone 150 $py -m pytest -q -p no:cacheprovider -ra $again
    fi
}
run_optimizer() {
    # the fair baselines (folded fused AdamW, the same captured in a CUDA graph, fullgraph
    # compile) beside eager and smddp; the compiles set what fits a 15-minute lease (on an H100
    # the fullgraph one took 46 s at 125M and over 140 s at 350M, the eager closure 26 s and 87 s,
    # and max-autotune-no-cudagraphs did not finish at 125M in 150 s). Each count builds every
    # variant's parameters afresh: at 1B that, not the timing, takes most of the limit
    step optimizer-step-125M 150 $py benchmarks/optimizer_step.py --device cuda --params 125M --rounds 10 \
        --no-eager-compile --json "$out/optimizer-step-125M.json"
    step optimizer-step-350M 90 $py benchmarks/optimizer_step.py --device cuda --params 350M --rounds 10 \
        --no-torch-compile --json "$out/optimizer-step-350M.json"
    step optimizer-step-1B 90 $py benchmarks/optimizer_step.py --device cuda --params 1B --rounds 10 \
        --no-torch-compile --json "$out/optimizer-step-1B.json"
}
run_quantize() {
    # a 25 MiB bucket's message and a large one, every wire dtype, the default block and a large
    # one; about a dozen Triton compiles, then 15 rounds of 10 calls of each variant
    step quantize-kernels 90 $py benchmarks/quantize_kernels.py --device cuda --numel 6.5M,64M \
        --json "$out/quantize-kernels.json"
}
run_train() {
    # end to end: DDP on nccl, DDP on smddp, smddp_lite.compile; GPT-2 small, one GPU
    step train-step 150 $py -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/train_step.py \
        --device cuda --json "$out/train-step.json"
}
run_compiled() {
    # GPT-2 small (12 x 768, sequence 1024, batch 8, float32): the compiles (torch.compile of DDP,
    # then the compiled step's blocks and the graphs between them) take most of the limit
    step compiled-vs-torch-compile 300 $py -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/compiled_vs_torch_compile.py --model gpt2-small --device cuda --rounds 3 \
        --json "$out/compiled-vs-torch-compile.json"
}
for part in $parts; do "run_$part"; done
echo "== $failed step(s) failed; the logs are in $out"
exit $failed
