export LEGATO_COMMIT=$(git log -1 --format=%h 2>/dev/null); export LEGATO_COMMIT=${C:-$LEGATO_COMMIT}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "gpu: $gpu"
if echo "$gpu" | grep -q H200; then
  VARIANTS="--variant f4=.:legato" CONC=256 LOOP_CONC=256 TL=150 T=210 bash benchmarks/h200_fronts.sh steady
  T=100 TOPOS="single split" bash benchmarks/h200_topologies.sh
else
  bash -c '. benchmarks/h200_env.sh; PYTHONPATH=.:$PYTHONPATH timeout 120 python3 benchmarks/voice_shapes.py --out $OUT/voice_shapes.json | tail -2'
  T=130 TOPOS="single" bash benchmarks/h200_topologies.sh
  T=100 TREE=.base TOPOS="single" bash benchmarks/h200_topologies.sh
  T=100 TOPOS="split" bash benchmarks/h200_topologies.sh
  T=100 TAG=-mps TOPOS="1p1d" SERVER_ARGS="--mps on" bash benchmarks/h200_topologies.sh
fi
