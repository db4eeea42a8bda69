#!/usr/bin/env bash
# The integration and e2e suites with CPU hogs beside them: a suite that passes only on a quiet machine
# hides races (a timing assertion, a service that starts only when nothing competes for the CPU). Run it
# before landing a change that touches services.
#
#   scripts/test_under_load.sh [pytest arguments...]     (default: tests/integration tests/e2e)
#
# HOGS busy processes (default: two per core) spin for as long as the suite runs and are stopped with it.
# The last line it prints is the figure: hogs=<n> passed=<n> failed=<n> errors=<n> minutes=<m>
# (a failed run's details are in the pytest output above it, and its JUnit report in $REPORT).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
HOGS=${HOGS:-$((2 * $(nproc)))}
REPORT=${REPORT:-$(mktemp -t stagetree-load-XXXXXX.xml)}
export STAGETREE_TEST_S3_URL=${STAGETREE_TEST_S3_URL:-http://127.0.0.1:5077}

hogs=()
stop_hogs() {
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null; done
    hogs=()
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM

for _ in $(seq 1 "$HOGS"); do
    (while :; do :; done) &
    hogs+=("$!")
done

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests/integration tests/e2e)

start=$(date +%s)
# --tb=native: pytest's own traceback style parses the test's source with ast, which on CPython 3.11 can
# fail with "AST constructor recursion depth mismatch" and end the whole session (an INTERNALERROR)
"$PY" -m pytest -q -p no:cacheprovider --tb=native --junitxml="$REPORT" "${args[@]}"
status=$?
end=$(date +%s)
stop_hogs

"$PY" - "$REPORT" "$HOGS" "$start" "$end" "$status" <<'EOF'
import sys
import xml.etree.ElementTree as ET

report, hogs, start, end, status = sys.argv[1:]
try:
    root = ET.parse(report).getroot()
except (OSError, ET.ParseError):
    # pytest died before writing its report (a crash, an interrupt): the run counts as one error
    print(f"hogs={hogs} passed=0 failed=0 errors=1 minutes={(int(end) - int(start)) / 60:.1f}")
    sys.exit(1)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
print(
    f"hogs={hogs} passed={passed} failed={count['failures']} errors={count['errors']}"
    f" minutes={(int(end) - int(start)) / 60:.1f}"
)
sys.exit(0 if status == "0" else 1)
EOF
