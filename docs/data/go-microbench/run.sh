#!/bin/bash
# Not a script to run as is: the paths are those of the session that recorded the data
# (/tmp/gonixl-base: the tree before the optimisations, with the same benchmark files).
# Interleaved before/after runs of the hot-path microbenchmarks.
# before: /tmp/gonixl-base (the tree before the optimisations, same benchmarks)
# after:  /work/main
set -e
OUT=${OUT:-/tmp/gmb}
COUNT=${COUNT:-10}
mkdir -p $OUT/bin
for t in base main; do
  src=/tmp/gonixl-base; [ $t = main ] && src=/work/main
  (cd $src && go test -c -o $OUT/bin/shim-$t.test ./shim && go test -c -o $OUT/bin/sc-$t.test ./sidechannel)
done
SHIM='ReadDescIDs|StepMeta|ParseNotif|PollNotifs|LeaseSweep|GetFinishedIdle'
SC='Handshake80L|AgentMetadata'
: > $OUT/before.txt; : > $OUT/after.txt
for i in $(seq $COUNT); do
  for t in base main; do
    f=$OUT/before.txt; [ $t = main ] && f=$OUT/after.txt
    (cd /work/main/shim && $OUT/bin/shim-$t.test -test.run '^$' -test.bench "$SHIM" -test.benchmem -test.count 1 -test.benchtime 0.3s) >> $f
    (cd /work/main/sidechannel && $OUT/bin/sc-$t.test -test.run '^$' -test.bench "$SC" -test.benchmem -test.count 1 -test.benchtime 0.3s) >> $f
  done
done
