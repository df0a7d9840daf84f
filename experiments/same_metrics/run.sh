#!/usr/bin/env bash
# Ten short runs covering every optional path of the loop (recompute + KL, resume, token
# level with logit noise, MoE Routing Replay and churn, MoE recompute + KL, the chain task,
# async rollouts, multi-turn tool episodes, two torchrun ranks), with the gspo package taken
# from SRC. Run it on two versions of the code and compare.py says whether their metrics
# (times aside) and ratio dumps are equal:
#
#   git worktree add /tmp/base <commit>
#   experiments/same_metrics/run.sh /tmp/base/src runs/same/before
#   experiments/same_metrics/run.sh src runs/same/after
#   .venv/bin/python experiments/same_metrics/compare.py runs/same/before runs/same/after
#
# About 5 minutes on 2 CPU cores per version. Give both output directories paths of the same
# length: a checkpoint holds its own path, so io/checkpoint_bytes differs by the difference.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SRC=$(cd "$1" && pwd); OUT=$2; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$SRC
G="$ROOT/.venv/bin/python -m gspo"
# a reward that varies within every group: the tasks' own are flat on these tiny models,
# and a run without advantages takes no step (varied.py)
VARIED="$ROOT/experiments/same_metrics/varied.py:varied"
FAST="reward.functions=[$VARIED] model.layers=1 model.hidden=64 model.heads=2 model.kv_heads=1 model.intermediate=128 data.eval_size=24 data.sft_size=200 train.cold_start_steps=20 train.cold_start_batch_size=16 rollout.group_size=4 rollout.prompts_per_batch=4 rollout.max_new_tokens=4 eval.samples=2 log.progress=false log.plots=false log.tensorboard=false"
MOE="reward.functions=[$VARIED] model.builtin=qwen3_moe model.layers=2 model.hidden=64 model.heads=2 model.kv_heads=1 model.intermediate=128 model.experts=4 data.eval_size=8 data.sft_size=64 train.cold_start_steps=10 rollout.group_size=4 rollout.prompts_per_batch=4 rollout.max_new_tokens=4 eval.samples=1 eval.max_prompts=4 log.progress=false log.plots=false log.tensorboard=false"
# dense: recompute + KL + ratio dumps + gradient cosines
$G train --overwrite --output-dir $OUT/dense $FAST train.max_steps=8 train.save_every=4 algorithm.old_logprobs=recompute algorithm.kl_coef=0.05 log.ratio_dump_every=1 optim.lr=3e-3 eval.every=4 > $OUT/dense.log 2>&1
# the same, cut at 4 then resumed to 8
$G train --overwrite --output-dir $OUT/cut $FAST train.max_steps=4 train.save_every=4 algorithm.old_logprobs=recompute algorithm.kl_coef=0.05 log.ratio_dump_every=1 optim.lr=3e-3 eval.every=4 > $OUT/cut.log 2>&1
$G train --resume $OUT/cut train.max_steps=8 >> $OUT/cut.log 2>&1
# dense sampler mode, token level, warmup, logit noise
$G train --overwrite --output-dir $OUT/token $FAST train.max_steps=8 algorithm.level=token rollout.logit_noise=0.3 optim.warmup_steps=3 optim.lr=3e-3 > $OUT/token.log 2>&1
# MoE with replay, churn, sampler mode, ratio dumps
$G train --overwrite --output-dir $OUT/moe_replay $MOE train.max_steps=8 moe.routing_replay=true log.ratio_dump_every=1 optim.lr=3e-2 > $OUT/moe_replay.log 2>&1
# MoE recompute + KL, churn, no replay
$G train --overwrite --output-dir $OUT/moe_recompute $MOE train.max_steps=8 algorithm.old_logprobs=recompute algorithm.kl_coef=0.05 optim.lr=3e-2 algorithm.level=sequence_token > $OUT/moe_recompute.log 2>&1
# chain task, longer responses
$G train --overwrite --output-dir $OUT/chain $FAST data.task=chain reward.functions=[numeric_match,$VARIED] data.terms=4 rollout.max_new_tokens=40 train.max_steps=8 log.ratio_dump_every=2 > $OUT/chain.log 2>&1
# async rollouts one batch ahead, recompute (the producer's own sampler and pi_old)
$G train --overwrite --output-dir $OUT/async $FAST train.max_steps=8 rollout.max_staleness=1 algorithm.old_logprobs=recompute > $OUT/async.log 2>&1
# multi-turn episodes with the calculator tool
$G train --overwrite --output-dir $OUT/tools $FAST reward.functions=[environment,$VARIED] data.task=calculator data.digits=3 rollout.max_new_tokens=24 rollout.max_turns=2 rollout.max_episode_tokens=64 train.max_steps=4 > $OUT/tools.log 2>&1
# torchrun, 2 ranks
PYTHONPATH=$SRC $ROOT/.venv/bin/torchrun --nproc_per_node 2 -m gspo train --overwrite --output-dir $OUT/ranks $FAST train.max_steps=8 train.save_every=4 algorithm.kl_coef=0.05 rollout.prompts_per_batch=4 > $OUT/ranks.log 2>&1
echo "runs written to $OUT"
