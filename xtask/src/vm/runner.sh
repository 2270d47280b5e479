# The functions of the test script that `cargo xtask test --kernel` runs in the guest
# (xtask/src/vm/suites.rs writes the rest: `k=KERNEL`, one `run` line per binary, `summary`).
# Plain POSIX sh: it runs under the host's /bin/sh.
failed=0
table=''

# run NAME DIR EXECUTABLE ARGS...: as `cargo test` runs a test binary, from its package's
# directory with CARGO_MANIFEST_DIR set; the host reads the `== NAME on KERNEL:` lines.
run() {
  name=$1 dir=$2
  shift 2
  echo "== $name on $k: running $*"
  t0=$(date +%s)
  (cd "$dir" && CARGO_MANIFEST_DIR="$dir" exec "$@") </dev/null
  rc=$?
  t=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then r=ok; else r=FAILED; failed=$((failed + 1)); fi
  echo "== $name on $k: $r ($t s)"
  table="$table$(printf '%-24s %-7s %6s s   exit %s' "$name" "$r" "$t" "$rc")
"
}

summary() {
  echo "== summary on $k ($(uname -r)): $failed failed"
  printf '%s' "$table"
  [ "$failed" -eq 0 ]
}
