# Sourced by the single-GPU device suites (h200_suite.sh, h200_sync_suite.sh).
# step NAME SECONDS CMD...: run CMD under a time limit, its output in $STEP_DIR/NAME.txt with the
# exit status appended, and its last lines on stderr (the device call's output tail).
step() {
  local name=$1 secs=$2; shift 2
  echo "== $name" >&2
  timeout "$secs" "$@" > "$STEP_DIR/$name.txt" 2>&1
  echo "rc=$?" >> "$STEP_DIR/$name.txt"
  tail -3 "$STEP_DIR/$name.txt" >&2
}
