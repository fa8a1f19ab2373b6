# interleaved rounds: old (39e16e2) and new (b6ee81d), alternating which goes first
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for w in $order; do
    if [ $w = old ]; then p=/tmp/old39; else p=/work/main; fi
    echo "$r $w $(PYTHONPATH=$p python3 /tmp/ab.py)"
  done
done
