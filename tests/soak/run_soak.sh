#!/usr/bin/env bash
# Usage: run_soak.sh DRIVER OUT_DIR [DRIVER ARGS...]
# Runs the soak's driver (ferry_soak) with --out OUT_DIR, then plots its time series
# (plot.sh: OUT_DIR/soak.png and a text plot) where gnuplot is installed. Exits as the driver
# did: 0 passed, 1 failed, 77 skipped.
set -uo pipefail
driver=$1
out=$2
shift 2
here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
mkdir -p -- "$out"
"$driver" --out "$out" "$@"
rc=$?
if [[ $rc -ne 77 && -s "$out/series.csv" ]]; then
  if command -v gnuplot >/dev/null; then
    "$here/plot.sh" "$out/series.csv" "$out/soak.png" || echo "run_soak: plot.sh failed"
  else
    echo "run_soak: no gnuplot, no plot (the series is $out/series.csv)"
  fi
fi
exit $rc
