#!/usr/bin/env bash
# Runs every Go fuzz target of the public API's request decoding and the
# E2B gateway's REST handlers, one at a time, for FUZZTIME each (default
# 10s: what `make fuzz-short` runs in CI; run longer by hand, e.g.
# FUZZTIME=5m scripts/fuzz.sh). Their seed corpora (testdata/fuzz and the
# f.Add seeds) also run in every plain `go test`. A failure leaves the
# input under the package's testdata/fuzz/<Target>/: check it in with the
# fix, and record long runs in bench/results (see 2026-12-01-fuzz.md).
# Needs no root.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-10s}
GO=${GO:-go}
targets=(
  "./internal/apiserver FuzzCreateSandbox"
  "./internal/apiserver FuzzExecRequest"
  "./internal/e2b FuzzCreateSandbox"
  "./internal/e2b FuzzRoutes"
)
rc=0
for t in "${targets[@]}"; do
  read -r pkg name <<<"$t"
  echo "== $pkg $name ($FUZZTIME)"
  # Each target alone (-run '^$' skips the package's tests, so none of its
  # root tests run); the servers' request logs go to a file.
  log=$(mktemp)
  ok=0
  for attempt in 1 2; do
    if nice -n 10 $GO test "$pkg" -run '^$' -fuzz "^${name}\$" -fuzztime "$FUZZTIME" >"$log" 2>&1; then
      ok=1; break
    fi
    # Go's fuzzing engine can end a clean run with a bare "context deadline
    # exceeded" when -fuzztime runs out while a worker is busy (no input is
    # written): that is not a finding, so run the target once more. A real
    # failure writes its input under testdata/fuzz and is never retried.
    if grep -q 'Failing input written' "$log" || ! grep -q '^    context deadline exceeded$' "$log"; then
      break
    fi
    echo "   (the fuzzing engine ended on its own deadline with no failing input; running $name again)"
  done
  if [ "$ok" != 1 ]; then
    grep -v 'level=\|^[0-9]\{4\}/[0-9][0-9]/[0-9][0-9] ' "$log" | tail -40
    rc=1
  else
    grep 'execs:' "$log" | tail -1
    grep '^ok' "$log" | tail -1
  fi
  rm -f "$log"
done
exit $rc
