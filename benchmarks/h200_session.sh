#!/usr/bin/env bash
# The GPU measurements of benchmarks/results/h200, as steps for the lent GPU machine (run them
# there through the device tool, from the repository root; outputs go to $OUT). Prepared here
# first (CPU machine, once):
#   echo /.devexp/ >> .git/info/exclude
#   TRIM=1 ../shared/device/prepare.sh $PWD/.devexp 30       # vLLM 0.26.0 in 30 MiB parts
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_17_x86_64 -d .devexp/tf \
#       transformers==5.14.1 tokenizers==0.22.2 huggingface-hub==1.33.0  # what vLLM 0.26 reads
#   pip wheel --no-deps --no-build-isolation -w .devexp/ours .  # for the plugin entry point
#   (only its dist-info is needed, the code comes from the tree on PYTHONPATH: a wheel of the
#   dist-info alone, 15 kB, leaves room for the MoE kernels beside part02 in the install call)
# Then, on the device, one call each, back to back (the machine forgets /tmp when it goes cold):
#   1. kernels  (carry .devexp/parts/vllm-trim.tar.xz.part00): kernel tests + benchmark (also
#               with a zero row ending each batch, as graph padding), no vLLM needed (SWEEP=1: also the centroid path's block-size sweep, ~40 s);
#               also stages part00 for step 2 ('stage' instead: only the
#               per-step launch kernels' tests and host costs, in seconds)
#   2. vllm     (carry part01, .devexp/wheels, .devexp/tf, .devexp/ours): installs vLLM, then
#               the verification tests (attention, index arrays, carried tokens, greedy
#               verification, draft start, count correction), their benchmarks and the GPU
#               engine test
#   3. e2e      (no carry): the end-to-end benchmark (about 5 minutes; E2E_K=2 for k=2 only;
#               E2E_ONLY=<name prefixes> picks engines; E2E_SCOPES=1 times host scopes;
#               E2E_ROUNDS timed rounds (5); E2E_V2=1 adds ours on Model Runner V2,
#               experimental: pick it with E2E_ONLY, e.g. "plain (V2,in-tree k=2,ours k=2 (V2")
#               E2E_TAIL=<lines> of the log shown)
#   4. profile  (no carry, optional): torch.profiler of ours (k=2) and of plain V1, batch 1,
#               with where the GPU idles waiting on the host
#   profile-real: torch.profiler of real_work.py's engine variants on the trained pair (or
#         e2b), B = 1 and 16, k = 3, engines started side by side and measured in turn
#   verify-kernels: after 'install', the capped argmax's tests and benchmark (CAPPED_SWEEP=1:
#         also its sizes' sweep, benchmarks/capped_argmax.py --sweep)
#   chain: instead of step 1 (carry part00): the small-rows matmul's and the fused query
#         norm / rotary embedding's CUDA tests and the draft layer chain with cuBLAS, our kernel
#         and the fused draft ops (benchmarks/draft_chain.py); torch + triton only
#   attention-chain: after 'install', our split attention's CUDA tests and verify_attention.py
#         with --chain 28 (as in the engine's graphs) and our kernel at other sizes; the
#         real-work variant to try goes to /tmp/split_variant (benchmarks/pick_split_sizes.py)
#   attention-sweep: our split verification attention's CUDA tests and its block-size sweep
#         (benchmarks/split_attention_sweep.py; no vLLM: chain it after 'part')
#   attention-kernels: after 'install', our split verification attention's and the segment
#         counts' CUDA tests, and verify_attention.py (vLLM's kernels at 16 / 8 / 4 segments
#         and ours, k=3, B = 1-64, contexts 256 and 2048)
#   draft-kernels: after 'install', the small-rows matmul's tests and benchmark
#         (SMALL_LINEAR_SWEEP=1: also its tile sweep), the flat-verify CUDA tests and
#         verify_attention.py
#   real: the real-work benchmark (benchmarks/real_work.py; REAL_PAIR=e2b|trained,
#         REAL_ARGS=<more arguments, split at spaces>; arguments after 'real' pass through
#         as given, e.g. --only "plain,ours-V2 k"), after 'install' or 'engine' in an earlier call
#   compile-ab: after 'install', one real run three times: every engine compiling, every one
#         loading from the compile cache, then one engine alone compiling (AB_RECOMPILE);
#         AB_RUNS picks (all three do not fit one call)
#   target-norms: after 'install', the target compile range's Inductor norms (ours-V2+target=1,
#         field k=2, B=1): torch.profiler of an engine that compiles, one that loads its
#         cache, one that compiles with Inductor's reduction filter (TARGET_NORMS_RUNS picks;
#         'default': ours-V2 at the same cell), and the generated norm kernels; about 230 s a
#         run that compiles (two runs a call)
#   norm-context: step 1's alternative (stages part00): the compiled norm after cuBLAS and
#         after our matmul at the target's shapes (small_linear.py --target --forward --norms)
#   tp2: on the two-GPU kind, after 'install': tests/test_gpu_tp.py, then real_work.py at TP=2
#         (TP2_TEST_ONLY=1: the test alone)
# With 30 MiB parts: 'part' calls carry one part each (copied to /tmp/stage); the call that
# installs carries the last part, and 'install' / 'vllm' / 'engine' read every part from
# /tmp/stage or .devexp/parts, in order. 'engine': install, then the GPU engine test, its V1 and
# V2 runner halves side by side (each is its own process).
# ('install' is step 2 without its tests, to chain another step in the same call.)
# Only committed code should be on the tree that travels: a half-written kernel breaks step 2.
# Carry sizes (64 MiB with the tree, ~16 MiB; keep large run files as .json.xz, which
# real_work.py --table reads, or the tree and a 30 MiB part no longer fit): part00 alone;
# part01 alone; part02 + .devexp/wheels in a 'part' call (which stages the wheels too);
# .devexp/tf + .devexp/ours with 'install'; the MoE kernels in a call of their own. The machine
# goes cold after 30 s without a call, and a cold machine has lost every staged part.
set -uo pipefail
step=${1:?usage: benchmarks/h200_session.sh part|stage|attention-chain|attention-sweep|chain|norm-context|kernels|vllm|install|engine|verify-kernels|draft-kernels|attention-kernels|e2e|real|compile-ab|target-norms|profile|profile-real|tp2}
: "${OUT:?OUT must be set (the device tool sets it)}"
export VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM's MoE kernels, cut from the trimmed vLLM (48 MB); prepared here with
#   unzip -p .devexp/vllm/vllm-0.26.0-*.whl vllm/$MOE_SO | xz -9 -T0 > .devexp/parts/$MOE_SO.xz
# and carried alone in a 'part' call of their own (39 MiB: with any other part over the limit).
MOE_SO=_moe_C_stable_libtorch.abi3.so
# Optional: committed copies of files to run instead of the tree's (e.g. while the kernels are
# being edited here), carried as .devexp/pinned/<path relative to the repo root>.
if [ -d .devexp/pinned ]; then (cd .devexp/pinned && find . -type f) | while read -r f; do
    cp ".devexp/pinned/$f" "$f" && echo "pinned $f"; done; fi
# Steps that need no vLLM stage part00 on the way, for a later install on this machine.
stage_part00() { mkdir -p /tmp/stage && cp .devexp/parts/vllm-trim.tar.xz.part00 /tmp/stage/; }
case "$step" in
stage)  # step 1 without the argmax kernels: the per-step launch kernels' tests and host costs
    stage_part00
    export PYTHONPATH=$PWD
    timeout 120 python3 -m pytest -q tests/test_draft_inputs.py \
        tests/test_graphed_launch.py "tests/test_greedy_verify.py::test_kernel_matches_reference_cuda" \
        > "$OUT/test_launch_kernels_cuda.log" 2>&1
    echo "launch kernel tests rc=$?"; tail -2 "$OUT/test_launch_kernels_cuda.log"
    timeout 100 python3 benchmarks/launch_overhead.py 2>&1 | grep -v Warning \
        | tee "$OUT/launch_overhead.log"
    ;;
chain)  # step 1's alternative, staging part00 as step 1 does
    stage_part00
    export PYTHONPATH=$PWD
    timeout 200 python3 -m pytest -q tests/test_small_linear.py tests/test_q_norm_rope.py \
        > "$OUT/test_small_linear_cuda.log" 2>&1
    echo "small-rows matmul and q norm/rope tests rc=$?"; tail -2 "$OUT/test_small_linear_cuda.log"
    timeout 200 python3 benchmarks/draft_chain.py --json "$OUT/draft_chain.json" \
        2>&1 | grep -v Warning | tee "$OUT/draft_chain.log"
    ;;
norm-context)  # why the 1-16 token graph's norms run slow (results/h100, 38th session)
    stage_part00
    export PYTHONPATH=$PWD
    timeout 300 python3 benchmarks/small_linear.py --target --forward --norms \
        --tokens "${NORM_TOKENS:-1,3,4,8,16}" --json "$OUT/norm_context.json" 2>&1 \
        | grep -v Warning | tee "$OUT/norm_context.log"
    ;;
kernels)
    stage_part00
    export PYTHONPATH=$PWD
    timeout 150 python3 benchmarks/centroid_argmax.py --tokens 1,2,3,4,5,8,16,32,64,256 \
        --reps 200 --json "$OUT/centroid_argmax.json" 2>&1 | tee "$OUT/centroid_argmax.log"
    # A batch ending in a zero row, as a draft graph's padding rows are (every score ties)
    timeout 100 python3 benchmarks/centroid_argmax.py --tokens 3,8,16,64,256 --zero-rows 1 \
        --reps 200 --variants ours-auto,ours-select,in-tree \
        --json "$OUT/centroid_argmax_zero_rows.json" 2>&1 | tee "$OUT/centroid_argmax_zero_rows.log"
    [ -n "${SWEEP:-}" ] && timeout 90 python3 benchmarks/centroid_argmax_sweep.py --reps 100 \
        2>&1 | grep -v Warning | tee "$OUT/centroid_sweep.log"
    timeout 300 python3 -m pytest -q tests/test_centroid_argmax_cuda.py \
        tests/test_draft_inputs.py tests/test_graphed_launch.py \
        > "$OUT/test_kernels_cuda.log" 2>&1
    echo "kernel tests rc=$?"; tail -3 "$OUT/test_kernels_cuda.log"
    ;;
vllm|install|engine)  # install alone: vLLM without the tests (then e2e in the same call)
    mkdir -p /tmp/site /tmp/tf
    # Every part must be here, in /tmp/stage (a 'part' call on this machine) or carried now: a
    # machine that went cold between calls has lost the parts staged on it.
    for n in 00 01 02; do
        [ -f "/tmp/stage/vllm-trim.tar.xz.part$n" ] || [ -f ".devexp/parts/vllm-trim.tar.xz.part$n" ] \
            || { echo "part$n is missing (the machine went cold?): carry it again"; exit 3; }
    done
    for n in 00 01 02 03 04 05 06 07 08 09; do
        for d in /tmp/stage .devexp/parts; do
            [ -f "$d/vllm-trim.tar.xz.part$n" ] && { cat "$d/vllm-trim.tar.xz.part$n"; break; }
        done
    done | tar -xJ -C /tmp/site; [ "${PIPESTATUS[1]}" = 0 ] || exit 3  # the loop ends on a miss
    # The trimmed vLLM lacks the MoE kernels (26B-A4B); staged separately when carried.
    for d in /tmp/stage .devexp/parts; do
        [ -f "$d/$MOE_SO.xz" ] && { xz -dc "$d/$MOE_SO.xz" > "/tmp/site/vllm/$MOE_SO"; break; }
    done
    [ -f "/tmp/site/vllm/$MOE_SO" ] || echo "no MoE kernels staged: the 26B-A4B shape cannot run"
    # The wheels: carried now, or staged by an earlier 'part' call that carried them.
    wheels() { ls .devexp/"$1"/*.whl 2>/dev/null || ls /tmp/stage/"$1"/*.whl; }
    pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        $(wheels wheels) $(wheels ours) 2>&1 | grep -v "as the 'root' user"
    pip install -q --no-index --no-deps --no-compile --target /tmp/tf $(wheels tf) \
        2>&1 | grep -v "as the 'root' user"
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    [ "$step" = install ] && exit 0
    if [ "$step" = engine ]; then  # ENGINE_EXTRA: more test files, each beside the others
        for t in ${ENGINE_EXTRA:-}; do
            timeout 560 python3 -m pytest -q -rs "$t" > "$OUT/$(basename "$t" .py).log" 2>&1 &
        done
        timeout 560 python3 -m pytest -q -k "not v2" tests/test_gpu_engine.py \
            > "$OUT/test_gpu_engine_v1.log" 2>&1 &
        # The V2 half without the cross-runner check (test_v2_drafts_equal_our_v1_proposers),
        # which starts the V1 half's engines again in its process: with both it outgrows one
        # call (13 engines, about a minute each); name it in ENGINE_EXTRA to run it alone.
        timeout 560 python3 -m pytest -q -k "v2 and not v1_proposers" tests/test_gpu_engine.py \
            > "$OUT/test_gpu_engine_v2.log" 2>&1
        echo "engine test V2 rc=$?"; wait; echo "all done"
        for f in "$OUT"/test_*.log; do echo "== $f"; tail -4 "$f"; done
        exit 0
    fi
    timeout 100 python3 benchmarks/draft_inputs.py --json "$OUT/draft_inputs.json" 2>&1 \
        | grep -v Warning  # imports the draft-graph sizes, hence vLLM
    timeout 100 python3 -m pytest -q tests/test_flat_verify_cuda.py tests/test_verify_metadata.py \
        tests/test_verify_input_ids.py tests/test_greedy_verify.py tests/test_verify_outcome.py \
        tests/test_computed_tokens.py > "$OUT/test_verify_cuda.log" 2>&1
    echo "verification tests rc=$?"; tail -2 "$OUT/test_verify_cuda.log"
    timeout 100 python3 benchmarks/verify_step.py --json "$OUT/verify_step.json" 2>&1 \
        | grep -v Warning | tee "$OUT/verify_step.log"
    timeout 100 python3 benchmarks/verify_attention.py --json "$OUT/verify_attention.json" \
        2>&1 | tee "$OUT/verify_attention.log" | grep -v Warning
    timeout 360 python3 -m pytest -q -x tests/test_gpu_engine.py > "$OUT/test_gpu_engine.log" 2>&1
    echo "engine test rc=$?"; tail -3 "$OUT/test_gpu_engine.log"
    ;;
e2e)
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    timeout "${E2E_TIMEOUT:-570}" python3 benchmarks/e2e_decode.py --workdir /tmp/e2b \
        --batch 1,8,32 --k "${E2E_K:-2,4}" \
        --start-timeout 400 --json "$OUT/e2e_decode.json" ${E2E_ONLY:+--only "$E2E_ONLY"} \
        ${E2E_SCOPES:+--scopes} ${E2E_V2:+--v2-experiment} --rounds "${E2E_ROUNDS:-5}" \
        > "$OUT/e2e.log" 2>&1
    echo "e2e rc=$?"; grep -v "Capturing\|it/s" "$OUT/e2e.log" | tail -"${E2E_TAIL:-12}"
    ;;
verify-kernels)  # after 'install': the capped argmax of greedy verification, tests + benchmark
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    timeout 200 python3 -m pytest -q tests/test_capped_argmax.py > "$OUT/test_capped_argmax_cuda.log" 2>&1
    echo "capped argmax tests rc=$?"; tail -2 "$OUT/test_capped_argmax_cuda.log"
    timeout 150 python3 benchmarks/capped_argmax.py --json "$OUT/capped_argmax.json" 2>&1 \
        | grep -v Warning | tee "$OUT/capped_argmax.log"
    if [ -n "${CAPPED_SWEEP:-}" ]; then  # our kernel at other splits, tiles and warps
        timeout 200 python3 benchmarks/capped_argmax.py --sweep --rows 1,8,24,48,96,192 \
            --reps 100 --json "$OUT/capped_argmax_sweep.json" 2>&1 | grep -v Warning \
            | tee "$OUT/capped_argmax_sweep.log"
    fi
    ;;
draft-kernels)  # after 'install': the draft step's kernels, tests and benchmarks
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    timeout 200 python3 -m pytest -q tests/test_small_linear.py tests/test_flat_verify_cuda.py \
        > "$OUT/test_draft_kernels_cuda.log" 2>&1
    echo "draft kernel tests rc=$?"; tail -2 "$OUT/test_draft_kernels_cuda.log"
    timeout 150 python3 benchmarks/small_linear.py ${SMALL_LINEAR_SWEEP:+--sweep} \
        --json "$OUT/small_linear.json" 2>&1 | grep -v Warning | tee "$OUT/small_linear.log"
    timeout 100 python3 benchmarks/verify_attention.py --json "$OUT/verify_attention.json" \
        2>&1 | grep -v Warning | tee "$OUT/verify_attention.log"
    ;;
attention-kernels)  # after 'install': the verification attention kernels, tests + benchmark
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    timeout 250 python3 -m pytest -q tests/test_split_attention.py tests/test_split_segments.py \
        tests/test_flat_verify_cuda.py > "$OUT/test_attention_kernels_cuda.log" 2>&1
    echo "attention kernel tests rc=$?"; tail -2 "$OUT/test_attention_kernels_cuda.log"
    timeout 300 python3 benchmarks/verify_attention.py --k 3 --batch 1,8,16,32,64 \
        --context 256,2048 --segments 8,4 --reps 100 --json "$OUT/verify_attention.json" 2>&1 \
        | grep -v Warning | tee "$OUT/verify_attention.log"
    ;;
attention-chain)  # after 'install': our split kernel's CUDA tests, then verify_attention.py
    # as the engine runs it (28 layers a graph), k=2, with our kernel at other sizes
    # (CHAIN_SIZES), and the real-work variant pick_split_sizes.py makes of it
    # (written to /tmp/split_variant for a 'real' call after this one)
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    timeout 120 python3 -m pytest -q tests/test_split_attention.py \
        > "$OUT/test_split_attention_cuda.log" 2>&1
    echo "split attention tests rc=$?"; tail -2 "$OUT/test_split_attention_cuda.log"
    sizes=${CHAIN_SIZES:-s1,c2,c4,s1_c2,s1_c4,m32,m32_c4,m128,m128_c2,w4}
    timeout "${CHAIN_TIMEOUT:-300}" python3 benchmarks/verify_attention.py --k "${CHAIN_K:-2}" \
        --chain 28 --reps 30 --batch 1,8,16,32,64 --context 256,2048 --segments 4 \
        --ours "$sizes" --json "$OUT/verify_attention_chain.json" 2>&1 | grep -v Warning \
        | tee "$OUT/verify_attention_chain.log"
    python3 benchmarks/pick_split_sizes.py "$OUT/verify_attention_chain.json" \
        > /tmp/split_variant && cat /tmp/split_variant
    ;;
attention-sweep)  # no vLLM needed: our split attention's CUDA tests and its block-size sweep
    export PYTHONPATH=${PYTHONPATH:-$PWD}
    timeout 200 python3 -m pytest -q tests/test_split_attention.py \
        > "$OUT/test_split_attention_cuda.log" 2>&1
    echo "split attention tests rc=$?"; tail -2 "$OUT/test_split_attention_cuda.log"
    timeout "${SWEEP_TIMEOUT:-300}" python3 benchmarks/split_attention_sweep.py \
        --json "$OUT/split_attention_sweep.json" ${SWEEP_ARGS:-} 2>&1 | grep -v Warning \
        | tee "$OUT/split_attention_sweep.log"
    ;;
part)  # only stage the carried parts of vLLM (and the MoE kernels, if carried)
    mkdir -p /tmp/stage && cp .devexp/parts/vllm-trim.tar.xz.part* /tmp/stage/ 2>/dev/null
    cp .devexp/parts/$MOE_SO.xz /tmp/stage/ 2>/dev/null
    for d in wheels tf ours; do  # wheels carried here, for an 'install' that does not carry them
        [ -d ".devexp/$d" ] && mkdir -p "/tmp/stage/$d" && cp .devexp/$d/*.whl "/tmp/stage/$d/"
    done; ls -lR /tmp/stage | grep -c whl; ls -l /tmp/stage
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    ;;
real)
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    pair=${REAL_PAIR:-e2b}
    timeout "${REAL_TIMEOUT:-570}" python3 benchmarks/real_work.py --pair "$pair" \
        --workdir /tmp/real --json "$OUT/real_work_$pair.json" ${REAL_ARGS:-} "${@:2}" \
        > "$OUT/real_work_$pair.log" 2>&1
    echo "real_work rc=$?"; grep -v "Capturing\|it/s" "$OUT/real_work_$pair.log" | tail -"${REAL_TAIL:-40}"
    ;;
compile-ab)  # one 'real' run three times: every engine compiles (caches removed), every engine
    # loads, then engine AB_RECOMPILE (default 2, the third) alone compiles; arguments after
    # 'compile-ab' replace the default run's. Whether compiling in the engine's own process
    # changes its steps (the start column says c or l).
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    pair=${REAL_PAIR:-e2b}
    args=(--k 2 --profiles field --batch 1,8 --rounds 4 --measure-cores 8
        --variants in-tree,ours-V2,ours-V2+target=1 --only "in-tree k=2,ours-V2")
    [ $# -gt 1 ] && args=("${@:2}")
    for run in ${AB_RUNS:-compiled loaded one-compiled}; do  # the three need two calls
        case $run in
        compiled) rm -rf /tmp/real/cache-"$pair"-* ;;
        one-compiled) rm -rf /tmp/real/cache-"$pair"-"${AB_RECOMPILE:-2}" ;;
        esac
        timeout "${REAL_TIMEOUT:-280}" python3 benchmarks/real_work.py --pair "$pair" \
            --workdir /tmp/real --json "$OUT/compile_ab_$run.json" "${args[@]}" \
            > "$OUT/compile_ab_$run.log" 2>&1
        echo "== $run rc=$?"
        sed -n "/^configuration/,/^\$/p" "$OUT/compile_ab_$run.log"
        grep -A4 "decode steps' ms a step" "$OUT/compile_ab_$run.log"
    done
    ;;
target-norms)  # the norms that read the target's matmul output in its 1-16 token graph: their
    # speed by process, and their generated code (benchmarks/results/h100, 37th-38th sessions)
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    for run in ${TARGET_NORMS_RUNS:-compiled loaded filtered}; do
        variant=ours-V2+target=1 cache=/tmp/norms-cache
        case $run in
        compiled) rm -rf $cache ;;
        filtered) variant=$variant+rfilter=1 cache=$cache-f; rm -rf $cache ;;
        default) variant=ours-V2 cache=$cache-d; rm -rf $cache ;;
        esac
        # vLLM points Inductor's cache into VLLM_CACHE_ROOT, whatever TORCHINDUCTOR_CACHE_DIR
        # says; an engine that compiles takes about 230 s here with the profiler
        VLLM_CACHE_ROOT=$cache timeout "${PROFILE_TIMEOUT:-400}" \
            python3 benchmarks/profile_decode.py --pair e2b --variant "$variant" --k 2 \
            --batch 1 --acceptance field --workdir /tmp/real \
            --kernels-json "$OUT/kernels_norms_$run.json" > "$OUT/profile_norms_$run.log" 2>&1
        echo "== $run rc=$?"
        sed -n '/^=====/p;/GPU busy/p' "$OUT/profile_norms_$run.log"
        mkdir -p "$OUT/inductor-$run"
        # a kernel's own file: one @triton.jit (a graph's output code names its kernels too)
        find "$cache" -name '*.py' -size -200k -print0 | xargs -0 -r grep -l \
            -e 'def triton_red_fused_add_rms_norm_target_linear' \
            -e 'def triton_red_fused_add_mul_rms_norm_target_linear' \
            -e 'def triton_red_fused_add_rms_norm_0(' -e 'def triton_red_fused_add_mul_rms_norm_4(' \
            | while read -r f; do
            [ "$(grep -c '@triton.jit' "$f")" = 1 ] || continue
            cp "$f" "$OUT/inductor-$run/"
        done
        # each kernel's name and hints (an inner reduction has one configuration: nothing is
        # timed at run time, so Inductor keeps no .best_config for these)
        for f in "$OUT/inductor-$run"/*.py; do
            [ -f "$f" ] || continue
            grep -h -o -e 'def triton_[a-z_0-9]*' -e "size_hints={[^}]*}" \
                -e 'reduction_hint=ReductionHint\.[A-Z_]*' "$f" | tr '\n' ' '
            echo
        done
    done
    ;;
profile)  # ours k=2 and plain V1 at batch 1 (PROFILE_RUNS picks others)
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    runs=${PROFILE_RUNS:-ours-k2 plain-v1}  # any of ours-k2 plain-v1 in-tree-k2
    for run in $runs; do
        case $run in
        ours-k2) args="--k 2"; cache=3; v1=1 ;;
        plain-v1) args="--k 0"; cache=1; v1=0 ;;
        in-tree-k2) args="--k 2 --in-tree"; cache=2; v1=1 ;;
        esac  # cache-N: the compile cache e2e_decode leaves for that engine, if it ran before
        env $([ $v1 = 0 ] && echo VLLM_USE_V2_MODEL_RUNNER=0) VLLM_CACHE_ROOT=/tmp/e2b/cache-$cache \
            timeout 280 python3 benchmarks/profile_decode.py --workdir /tmp/e2b $args --batch 1 \
            > "$OUT/profile_$run.log" 2>&1
        echo "profile $run rc=$?"; sed -n '/^decode step/p;/^per decode step/,/CPU busy/p' \
            "$OUT/profile_$run.log"
        sed -n '/^GPU timeline/,/^$/p' "$OUT/profile_$run.log"
    done
    ;;
profile-real)  # torch.profiler per engine variant (profile_decode.py), started side by side,
    # measured one at a time: PROFILE_VARIANTS (name[:draft-argmax] ...), PROFILE_PAIR,
    # PROFILE_K, PROFILE_BATCH, PROFILE_ACCEPTANCE (e2b: zero, field or poor); PROFILE_PY=1
    # adds the Python side (cProfile)
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site
    variants=${PROFILE_VARIANTS:-plain in-tree ours-V2 ours-V2:full-logits ours-V1}
    # A variant spec's name and draft argmax, and its files' stem: the device tool does not
    # bring back a file name with '+' or '='.
    parse_spec() { v=${1%%:*}; argmax=ours; [ "$v" != "$1" ] && argmax=${1#*:}
        stem=${v//[+=]/_}_$argmax; }
    logs=()
    for spec in $variants; do
        parse_spec "$spec"
        logs+=("$OUT/profile_$stem.log")
        VLLM_CACHE_ROOT=/tmp/prof-cache-$stem timeout "${PROFILE_TIMEOUT:-520}" \
            python3 benchmarks/profile_decode.py --pair "${PROFILE_PAIR:-trained}" \
            --variant "$v" --draft-argmax "$argmax" --k "${PROFILE_K:-3}" \
            --batch "${PROFILE_BATCH:-1,16}" --lock /tmp/profile.lock --workdir /tmp/real \
            --acceptance "${PROFILE_ACCEPTANCE:-zero}" \
            --graph-census ${PROFILE_PY:+--py-profile} \
            --kernels-json "$OUT/kernels_$stem.json" > "${logs[-1]}" 2>&1 &
    done
    wait
    for log in "${logs[@]}"; do
        sed -n '/^=====/p;/^CUDA-graph replays/,/^per output token/p;/^per output token/,/CPU busy/p;/^GPU timeline/,/^$/p' "$log"
    done
    # Each variant's kernels against the first's (e.g. plain), batch by batch
    set -- $variants; parse_spec "$1"; first=$stem
    for f in "$OUT"/kernels_*-b*.json; do
        case $f in *"/kernels_$first-"*) continue ;; esac
        b=${f##*-b}; python3 benchmarks/kernel_diff.py --rows 15 \
            "$OUT/kernels_$first-b$b" "$f" 2>&1
    done
    ;;
tp2)  # two GPUs (nvidia-h200-x2), after 'install': the TP=2 engine test and the speed rows
    # at TP=2 (synthetic [0.85, 0.70, 0.55] and zero acceptance, k=2, B = 1 / 8 / 32).
    # NVLink multicast stays off (the machine's rule), here and in every engine process.
    export PYTHONPATH=$PWD:/tmp/tf:/tmp/site NCCL_NVLS_ENABLE=0 \
        TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
    timeout 560 python3 -m pytest -q -rs tests/test_gpu_tp.py > "$OUT/test_gpu_tp.log" 2>&1
    echo "TP=2 engine test rc=$?"; tail -4 "$OUT/test_gpu_tp.log"
    [ -n "${TP2_TEST_ONLY:-}" ] && exit 0
    timeout "${REAL_TIMEOUT:-570}" python3 benchmarks/real_work.py --pair e2b --workdir /tmp/real \
        --tensor-parallel 2 --k 2 --profiles field,zero --batch 1,8,32 --rounds 4 \
        --variants in-tree,ours-V2 --json "$OUT/real_work_e2b_tp2.json" \
        > "$OUT/real_work_e2b_tp2.log" 2>&1
    echo "real_work TP=2 rc=$?"; grep -v "Capturing\|it/s" "$OUT/real_work_e2b_tp2.log" | tail -25
    ;;
*) echo "unknown step $step"; exit 2 ;;
esac
