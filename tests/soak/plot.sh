#!/usr/bin/env bash
# Usage: plot.sh SERIES.csv OUT.png
# Plots a soak's time series (ferry_soak's series.csv): the driver's RSS and open descriptors,
# the p50/p99 latency of each sample's completed operations, and the operations ended by
# outcome, into OUT.png; and prints the RSS and p99 as text plots.
set -euo pipefail
csv=$1
png=$2
# Columns: 1 t_s, 2 started, 3 ended, 4 complete, 5 cancelled, 6 errored, 7 lost, 8 corrupt,
# 9 bytes_verified, 10 rss_kb, 11 fds, 12 live_ops, 13 workers_rss_kb, 14 p50_us, 15 p99_us,
# 16 window_ops, 17 nats_up, 18 kills, 19 nats_restarts
gnuplot <<GP
set datafile separator ','
set key autotitle columnhead
set terminal png size 1000,900
set output '$png'
set multiplot layout 3,1 title 'ferry soak: $csv'
set xlabel 'seconds'
set ylabel 'MiB'
set y2label 'fds'
set y2tics
set ytics nomirror
plot '$csv' using 1:(\$10/1024) with lines title 'driver RSS (MiB)', \
     '' using 1:(\$13/1024) with lines title 'workers RSS (MiB)', \
     '' using 1:11 axes x1y2 with lines title 'driver fds'
unset y2label
unset y2tics
set ylabel 'ms'
set logscale y
plot '$csv' using 1:(\$14/1000) with linespoints title 'p50', \
     '' using 1:(\$15/1000) with linespoints title 'p99'
unset logscale y
set ylabel 'operations'
plot '$csv' using 1:4 with lines title 'complete', '' using 1:5 with lines title 'cancelled', \
     '' using 1:6 with lines title 'errored', '' using 1:(\$7+\$8) with lines title 'lost+corrupt', \
     '' using 1:(\$17==0 ? \$4 : 1/0) with points pt 7 lc rgb 'red' title 'nats-server down'
unset multiplot
set terminal dumb size 100,22
set output
unset y2tics
unset logscale y
set ylabel 'MiB'
set title 'driver RSS (MiB) over seconds'
plot '$csv' using 1:(\$10/1024) with lines notitle
set ylabel 'ms'
set title 'p99 latency (ms) over seconds'
plot '$csv' using 1:(\$15/1000) with lines notitle
GP
echo "plot.sh: wrote $png"
