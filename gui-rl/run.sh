#!/usr/bin/env bash
# gui-rl: train an agent to operate web pages in headless Chromium: MiniWoB++ tasks (split by seed) and
# OSWorld-style tasks on local pages (split by task), judged by each task's own checker. Needs Debian's
# chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run installs them).
#
#   bash gui-rl/run.sh [key=value ...]
#
# `clawrl serve` with env.name=gui: rollouts of env.group_size episodes per task, each in a pooled browser
# (env.gui_browsers at once), trained by the same learner, buffer, trainer, checkpoints and weight swap
# as the chat methods, while the OpenAI endpoint keeps serving the policy being trained. Useful keys:
#   run_dir=D                where episodes, samples, checkpoints and metrics.jsonl go (resumes from D)
#   env.max_train_steps=N    stop after N train steps: save, evaluate on env.eval_split, exit 0
#   env.eval_every=N         held-out evaluation every N steps (into metrics.jsonl and WandB as eval/*)
#   env.split=train_click env.eval_split=test_click   the click family alone (the learning run, README.md)
# Then `clawrl env eval gui-rl --split test --run-dir D` scores the newest checkpoint.
# The tasks alone: clawrl env list|check gui-rl; clawrl env run gui-rl --task ID --policy oracle|nop|model
#
# Several nodes (trainer.backend=megatron; docs/multi_node.md): run this same script on every node.
# These pass through to `clawrl serve`, which decides what this node runs: node 0 serves the endpoint
# and drives training, every other node runs only its trainer ranks (the torch backend ignores them).
#   NNODES              nodes in the run (default 1)
#   NODE_RANK           this node, 0..NNODES-1 (default 0)
#   MASTER_ADDR         node 0's address, reachable from every node (required when NNODES > 1)
#   MASTER_PORT         node 0's rendezvous port (default 29500; on one machine, a free port)
#   GPUS_PER_NODE       trainer ranks on this node (default: its CUDA devices)
#   CLAWRL_CLUSTER_KEY  key of node 0's control channel to its trainer ranks (default: random per run)
set -euo pipefail
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Where the embedded model, caches and default runs live (clawrl.paths.data_dir).
export CLAWRL_HOME="${CLAWRL_HOME:-$HOME/.cache/clawrl}"
# One BLAS/OpenMP thread pool per core: torch's default oversubscribes small machines when the
# engine and the trainer run at the same time.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-$OMP_NUM_THREADS}"
# Tokenizers' own thread pool fights the engine for the same cores and warns after fork.
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"

# `clawrl` is the console script `pip install -e .` installs; in a checkout that is not installed
# (PYTHONPATH=core, e.g. a GPU image with its own torch) the same entry point runs as a module.
CLAWRL=(clawrl)
command -v clawrl >/dev/null 2>&1 || CLAWRL=(python3 -m clawrl.cli)
exec "${CLAWRL[@]}" serve --config "$DIR/config.yaml" "$@"
