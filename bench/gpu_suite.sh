#!/usr/bin/env bash
# The wheels bench/gpu_suite.py needs on a GPU machine that has torch, transformers, peft,
# accelerate, pyarrow and triton but not TRL, and no internet:
#
#   bench/gpu_suite.sh download     # where PyPI is reachable, in dpocache's venv: into bench/wheels/ (~3 MiB)
#   bench/gpu_suite.sh install      # on the GPU machine: those wheels, no index, no dependencies; dpocache
#   bench/gpu_suite.sh run [ARGS]   # install, then python bench/gpu_suite.py ARGS
#   bench/gpu_suite.sh session OUT [ARGS]  # a lent GPU's one call: install, the suite (at most $SUITE_S s, 420), then
#                                   # the GPU tests (at most $TESTS_S s, 150; 0: none; $GPU_TESTS: which, in order,
#                                   # default all, each named as it ends, -k allowed); the result, its log, the
#                                   # tests' output (and --profile's tables) into OUT, the machine's paths in its
#                                   # text files written as <repo>, <out>, <venv>, <tmp> (results are committed)
#   bench/gpu_suite.sh scrub OUT    # that last step alone, on OUT's .txt and .log files
#
# The wheels: TRL 1.16.0 and, of what it imports, what such a machine lacks (datasets, and
# datasets' dill and multiprocess, at this venv's versions), plus liger-kernel 0.8.5 for
# dpocache's --kernels liger. Everything else TRL and datasets require (accelerate, fsspec,
# huggingface-hub, jinja2, numpy, pandas, psutil, pyarrow, pyyaml, tqdm, xxhash, ...) is there.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
PY=${PYTHON:-python3}  # a GPU machine may have python3 only (its torch is there)

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }

download() {
    mkdir -p "$WHEELS"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" \
        trl==1.16.0 "datasets==$(version datasets)" "dill==$(version dill)" \
        "multiprocess==$(version multiprocess)" liger-kernel==0.8.5
    ls -l "$WHEELS"
    du -sh "$WHEELS"
}

install() {
    "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl
    # dpocache itself; where the editable install cannot build offline, run puts the tree on PYTHONPATH
    "$PY" -m pip install --no-deps --no-build-isolation -e . || echo "dpocache not installed: run uses PYTHONPATH"
    # The versions the wheels were installed against, without their dependencies (a mismatch shows at import)
    "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|peft|accelerate|trl|datasets|liger.kernel|pyarrow|fsspec|pandas|xxhash|triton|numpy|huggingface.hub|multiprocess|dill) " || true
    "$PY" -c "import trl, datasets, liger_kernel; print('trl', trl.__version__, 'datasets', datasets.__version__)" \
        || echo "an import failed: the rows that need it will say so"
}

session() {
    local out="$1"
    shift
    mkdir -p "$out"
    install >"$out/install.txt" 2>&1 || echo "install failed (install.txt); going on with what is installed"
    # absolute: tests start python -m dpocache from other working directories
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # The measurement first: each finished row is in the result at once, so a timeout keeps them.
    timeout "${SUITE_S:-420}" "$PY" bench/gpu_suite.py --out "$out/gpu-suite.json" "$@" 2>&1 | tee "$out/gpu-suite.txt" \
        | tail -40 || true
    cp "$(ls -t bench/work/gpu-suite-*.log 2>/dev/null | head -1)" "$out/" 2>/dev/null || true  # this run's log
    if [ "${TESTS_S:-150}" -gt 0 ]; then
        # shellcheck disable=SC2086  # $GPU_TESTS: test paths, split on spaces
        timeout "${TESTS_S:-150}" "$PY" -m pytest -v -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} \
            >"$out/gpu-tests.txt" 2>&1 || true
        tail -15 "$out/gpu-tests.txt"
    fi
    scrub "$out"
}

# The machine's own paths out of the text files a session leaves in OUT, and torch's empty
# DEBUG trace lines (TORCH_LOGS) out of the tests' output: they are committed with the results.
# Plain string replacement (no regular expression built from a path), the longest path first (a
# venv inside the repository keeps its own name), the Python prefix only where it is a venv.
scrub() {
    "$PY" - "$1" "$PWD" <<'EOF'
import re
import sys
from pathlib import Path

out, repo = Path(sys.argv[1]).resolve(), sys.argv[2]
names = {str(out): "<out>", repo: "<repo>"}
if sys.prefix != sys.base_prefix:
    names[sys.prefix] = "<venv>"
pytest_tmp = re.compile(r"/tmp/pytest-of-[^/\s]*/pytest-\d+")
for path in sorted([*out.glob("*.txt"), *out.glob("*.log")]):
    lines = path.read_text(errors="surrogateescape").splitlines(keepends=True)
    text = "".join(line for line in lines if "DEBUG    torch.__trace" not in line)
    for name in sorted(names, key=len, reverse=True):
        text = text.replace(name, names[name])
    path.write_text(pytest_tmp.sub("<tmp>", text), errors="surrogateescape")
EOF
}

case "${1:-}" in
    download) download ;;
    install) install ;;
    run) shift; install; PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" bench/gpu_suite.py "$@" ;;
    session) shift; session "${1:?usage: bench/gpu_suite.sh session OUT [gpu_suite.py options]}" "${@:2}" ;;
    scrub) shift; scrub "${1:?usage: bench/gpu_suite.sh scrub OUT}" ;;
    *) echo "usage: bench/gpu_suite.sh download | install | run [gpu_suite.py options] | session OUT [options]" \
        "| scrub OUT" >&2; exit 2 ;;
esac
