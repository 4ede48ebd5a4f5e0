#!/usr/bin/env bash
# Make (or find) a venv that holds one torch release and nothing else, for the version matrix.
#   ci/torch-venv.sh VERSION      -> prints the venv's python
# The venv lives in $HOOKSCOPE_CI_CACHE (default ~/.cache/hookscope-ci), so a re-run finds it.
# Everything but torch (transformers, lightning, pytest, numpy, ...) comes from the main .venv:
# a .pth appends its site-packages AFTER the venv's own, then the checkout's src/ for hookscope
# (a directory added by a .pth does not have its own .pth files read, so the editable install
# of hookscope in .venv is not seen).
# 2.14.1 (a CUDA build, used on the CPU) installs with its nvidia-cu13 libraries from this
# machine's disk. Older releases are CUDA 12 builds from the registry: the first (2.9.1) installs
# with its nvidia-cu12 libraries; the others install torch alone and share those libraries through
# a symlink (torch finds them by its RPATH, $ORIGIN/../../nvidia/...). cuDNN 9 and CUDA 12 keep
# their ABI across these releases, and on the CPU they only need to load.
set -euo pipefail
VER=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${HOOKSCOPE_CI_CACHE:-$HOME/.cache/hookscope-ci}
MAIN_PY=$ROOT/.venv/bin/python
BASE_PY=$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')
MAIN_SITE=$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VENV=$CACHE/torch-$VER
SHARED_CU12=${SHARED_CU12:-2.9.1}   # the release whose nvidia-cu12 libraries the others borrow
PIP=(-m pip install -q --disable-pip-version-check)
mkdir -p "$CACHE"

link_main() {  # after torch is in: pip would otherwise see (and try to replace) .venv's torch
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%s\n%s\n' "$MAIN_SITE" "$ROOT/src" >"$site/zz-hookscope-ci.pth"
}
if [ ! -f "$VENV/.installed" ]; then
    rm -rf "$VENV"
    "$BASE_PY" -m venv "$VENV"
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    case $VER in
        2.1[0-9]*|"$SHARED_CU12")
            "$VENV/bin/python" "${PIP[@]}" "torch==$VER" ;;
        *)
            "$0" "$SHARED_CU12" >/dev/null
            "$VENV/bin/python" "${PIP[@]}" --no-deps "torch==$VER"
            LENDER=$("$CACHE/torch-$SHARED_CU12/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
            ln -s "$LENDER/nvidia" "$SITE/nvidia"
            # 2.7's cuSPARSELt package (0.6) lay at the top level, not under nvidia/
            ln -s "$LENDER/nvidia/cusparselt" "$SITE/cusparselt" ;;
    esac
    case $VER in  # transformers 5 needs torch>=2.6: older releases get the last 4.x
        2.[0-5].*) link_main && "$VENV/bin/python" "${PIP[@]}" "transformers<5" ;;
    esac
    touch "$VENV/.installed"
fi
link_main
echo "$VENV/bin/python"
