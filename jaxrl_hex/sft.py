"""Supervised warm start: teacher forcing on a task's answers until held-out accuracy reaches
a target, so that RL starts from a policy that sometimes succeeds."""
import time

import jax

from jaxrl_hex.data.prompts import PromptStream
from jaxrl_hex.evaluation import evaluate
from jaxrl_hex.metrics import Progress
from jaxrl_hex.rl.batch import sft_batch
from jaxrl_hex.rl.objectives import sft_loss
from jaxrl_hex.rl.trainer import Trainer, make_optimizer
from jaxrl_hex.rollout.engine import Engine
from jaxrl_hex.tasks import is_episodic
from jaxrl_hex.tasks.scoring import RewardScorer


def run_sft(rt, params, recorder, checkpointer=None, phase="sft", policy=None):
  """Returns (the whole params, summary). Logs rows tagged with `phase` to the recorder. policy:
  the model trained (default the run's; a LoRA run's warm start trains its base, policy.base())."""
  s = rt.cfg.sft
  pool = rt.pool("train")
  policy = policy or rt.policy
  trainer = Trainer(policy, pool, make_optimizer(s, s.max_steps), sft_loss, params)
  stream = PromptStream(rt.task.train, s.batch_size, seed=rt.cfg.seed)
  engine = Engine(policy, pool, rt.tokenizer, rt.cfg.rollout.max_new_tokens,
                  max_prompt_len=rt.cfg.rollout.max_prompt_len)  # the task's prompts were checked against it
  # an environment or agent scores its own episodes
  scorer = None if is_episodic(rt.task) else RewardScorer(rt.task, rt.cfg.rollout.reward_timeout_s)
  eval_records = list(rt.task.eval[:s.eval_size])
  # the phase ends at the accuracy target, usually long before max_steps: the console says so
  progress = Progress(phase, s.max_steps, rt.cfg.train.log_every,
                      target=("eval_accuracy", s.target_accuracy) if s.target_accuracy > 0 else None)
  accuracy = evaluate(engine, scorer, eval_records, 0, trainer.whole(), len(eval_records), rt.task)
  start_accuracy, t0 = accuracy, time.time()
  recorder.log({"phase": phase, "step": 0, "eval_accuracy": accuracy, "wall_s": time.time() - recorder.t0})
  step = 0
  while step < s.max_steps and not (0 < s.target_accuracy <= accuracy):
    records, _ = stream.next()
    m = trainer.step(sft_batch(rt.tokenizer, records, rt.task))
    step += 1
    row = {
        "phase": phase,
        "step": step,
        "loss": m["loss"],
        "token_accuracy": m["token_accuracy"],
        "train_tokens_per_s": m["train_tokens_per_s"],
        "wall_s": time.time() - recorder.t0
    }
    if step % s.eval_every == 0 or step == s.max_steps:
      accuracy = row["eval_accuracy"] = evaluate(engine, scorer, eval_records, step, trainer.whole(), len(eval_records),
                                                 rt.task)
    recorder.log(row)
    progress.update(step, row)
  if checkpointer is not None:
    checkpointer.save(step, trainer.state(), {"phase": phase, "step": step, "eval_accuracy": accuracy})
    checkpointer.wait()
  if scorer is not None:
    scorer.close()
  summary = {
      "steps": step,
      "eval_accuracy_start": start_accuracy,
      "eval_accuracy_end": accuracy,
      "seconds": time.time() - t0
  }
  progress.close(f"{phase}: {step} steps, eval accuracy {start_accuracy:.3f} -> {accuracy:.3f} "
                 f"in {summary['seconds']:.0f}s")
  return jax.block_until_ready(trainer.whole()), summary
