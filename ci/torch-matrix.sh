#!/usr/bin/env bash
# The torch version matrix: the tests that touch torch's internals, on the releases hookscope
# supports besides the 2.13.0 of `make test` (which runs the whole suite first, in .ci/run).
#   ci/torch-matrix.sh              every leg below; fails if any leg fails
#   ci/torch-matrix.sh 2.9.1 ...    those legs only
#   ci/torch-matrix.sh --install    only make the venvs (ci/torch-venv.sh; cached in
#                                   ~/.cache/hookscope-ci, so .ci/run starts it before
#                                   `make test` and a re-run installs nothing)
# Prints per leg: the torch that ran (asked of torch itself), passed/failed/skipped, seconds.
#
# Which tests each leg runs, and why (the whole of .ci/run must stay well under 40 minutes
# on a 2-core machine: `make test` takes ~10 of them, cold installs ~8 more, overlapped with it):
# - 2.14.1, the newest release: the files that lean on autograd and module internals (the hook
#   layer and what it replaces in torch, pickling, non-finite checks, the Monitor). Its compiled
#   paths are left to the 2.13.0 suite and the 2.9.1 leg, to keep CI's time (test_compile alone
#   is most of a leg); the whole suite passed on 2.14.1 at the start of the fourth round.
# - 2.9.1, the last release before Dynamo's zip(strict=) fix and the oldest whose compiled
#   paths still run: the compiled files and the internals files.
# - 2.7.1, the Monitor's floor (Dynamo's per-code frame strategies, set_stance): the Monitor
#   eager, the hook layer, capture and intervene; its compiled paths are not promised.
# - 2.4.1, the floor of the eager verbs: capture, intervene, extract, summary, explain,
#   patching, the logit lens, the hook layer, and the Monitor refused with a message.
# tests/test_compat.py runs on every leg.
set -uo pipefail
set -f  # test ids hold [params]: never globs
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

COMPILED="tests/test_compile.py tests/test_compiled_passes.py tests/test_compare.py tests/test_transfer.py"
INTERNALS="tests/test_hooks.py tests/test_sites.py tests/test_pickle.py tests/test_guest.py
  tests/test_nonfinite.py tests/test_monitor.py tests/test_wiring.py
  tests/test_loss_and_clipping.py tests/test_attention.py"
EAGER="tests/test_capture.py tests/test_intervene.py tests/test_extract.py tests/test_summary.py"
INTERP="tests/test_explain.py tests/test_patching.py tests/test_logit_lens.py"

# Below 2.7 the Monitor is refused (tests/test_compat.py checks how), so not attached.
ATTACH=tests/test_hooks.py::test_a_verb_that_fails_while_attaching_leaves_only_the_hooks_that_were_there
NO_MONITOR="--deselect $ATTACH[gpt2-Monitor] --deselect $ATTACH[cnn_inplace_relu-Monitor]"
# Torch older than 2.6 has transformers 4.x (ci/torch-venv.sh: transformers 5 needs 2.6): these
# tests call transformers 5's API (activation_checkpointing_enable; a GPT2Block returning a
# tensor, not a tuple) or its module names (ViT's encoder.layers, GPT-NeoX's lm_head).
OLD_TRANSFORMERS="
  --deselect tests/test_sites.py::test_checkpoint_re_runs_map_to_the_call_they_repeat_on_gpt2
  --deselect tests/test_intervene.py::test_intervening_on_checkpointed_gpt2_gives_the_gradients_of_the_plain_model
  --deselect tests/test_extract.py::test_extract_gpt2_block_0_equals_hidden_states_1_and_restores_training
  --deselect tests/test_explain.py::test_vit_class_token_grid_is_found_without_a_reshape
  --deselect tests/test_explain.py::test_vit_model_without_logits_with_a_callable_target
  --deselect tests/test_logit_lens.py::test_logit_lens_finds_norm_and_unembedding[neox]"

args_for() {  # sets ARGS: pytest's arguments for leg $1
    case $1 in
        2.14.1) ARGS=(tests/test_compat.py $INTERNALS) ;;
        2.9.1) ARGS=(tests/test_compat.py $COMPILED $INTERNALS) ;;
        2.7.1) ARGS=(tests/test_compat.py $INTERNALS $EAGER) ;;
        2.4.1) ARGS=(tests/test_compat.py tests/test_hooks.py tests/test_sites.py $EAGER $INTERP
            $NO_MONITOR $OLD_TRANSFORMERS) ;;
        *) ARGS=(tests/test_compat.py) ;;
    esac
}

LEGS=(2.14.1 2.9.1 2.7.1 2.4.1)
if [ "${1:-}" = --install ]; then
    for v in "${LEGS[@]}"; do
        start=$SECONDS
        ci/torch-venv.sh "$v" >/dev/null || exit 1
        echo "torch-matrix: venv for torch $v ready in $((SECONDS - start)) s"
    done
    exit 0
fi
[ $# -gt 0 ] && LEGS=("$@")

TMP=${TMPDIR:-/tmp}
failed=0
summary=()
for v in "${LEGS[@]}"; do
    start=$SECONDS
    if ! py=$(ci/torch-venv.sh "$v"); then
        summary+=("torch $v: venv failed to install")
        failed=1
        continue
    fi
    ran=$("$py" -c 'import torch; print(torch.__version__)')
    case $ran in
        "$v" | "$v"+*) ;;
        *)
            summary+=("torch $v: the venv runs torch $ran")
            failed=1
            continue
            ;;
    esac
    xml=$TMP/hookscope-matrix-$v.xml
    rm -f "$xml"
    args_for "$v"
    echo "=== torch $ran: ${ARGS[*]}"
    "$py" -m pytest "${ARGS[@]}" -q -p no:cacheprovider --basetemp="$TMP/pt-matrix-$v" \
        --junitxml="$xml" || failed=1
    counts=$("$py" - "$xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(f"{n - f - e - s} passed, {f + e} failed, {s} skipped")
EOF
    ) || counts="no results"
    summary+=("torch $ran: $counts in $((SECONDS - start)) s")
done
echo "=== torch version matrix"
printf '%s\n' "${summary[@]}"
exit $failed
