"""Tasks: prompt/answer records, a reward, and the tokenizer that reads them.

A user task is a Python file with `make_task(config) -> Task`, named on the command line as
`--config.task=path/to/file.py:make_task`; built-in tasks are registered by name below. A
multi-turn task (tools, an environment that answers) returns an EnvTask instead
(jaxrl_hex/tasks/environment.py), named the same way.
"""
from jaxrl_hex.specs import load_object
from jaxrl_hex.tasks.agent import AgentTask, agent_demo, agent_prompt
from jaxrl_hex.tasks.environment import EnvTask, demo_tokens, first_prompt
from jaxrl_hex.tasks.task import Task, TaskError

__all__ = ["AgentTask", "EnvTask", "Task", "TaskError", "load_task"]

BUILTIN = {
    "arith": "jaxrl_hex.tasks.arithmetic:make_task",
    "arith_chat": "jaxrl_hex.tasks.chat_arithmetic:make_task",
    "arith_chat_sub": "jaxrl_hex.tasks.chat_arithmetic:make_subtraction",
    "files": "jaxrl_hex.tasks.files:make_task",
    "calculator": "jaxrl_hex.tasks.calculator:make_env",
    "guess": "jaxrl_hex.tasks.guess:make_env",
}


def load_task(spec: str, config, check_prompts: bool = False) -> Task:
  """spec: a built-in name, 'module.path:fn', or 'path/to/file.py:fn'. check_prompts: every prompt
  the run will generate from fits config.rollout.max_prompt_len (check_prompt_lengths)."""
  spec = BUILTIN.get(spec, spec)
  if ":" not in spec:
    raise TaskError(f"task: {spec!r} is neither a built-in task {sorted(BUILTIN)} nor 'path/to/file.py:make_task'")
  task = load_object(spec, "task")(config)
  if not isinstance(task, (Task, EnvTask, AgentTask)):
    raise TaskError(f"task: {spec} returned {type(task).__name__}, not jaxrl_hex.tasks.Task, EnvTask or AgentTask")
  if check_prompts:
    check_prompt_lengths(task, config.rollout.max_prompt_len, max(config.train.eval_size, config.sft.eval_size))
  return task


def is_episodic(task) -> bool:
  """Episodes, scored as they run (an environment's, or an agent's through the OpenAI endpoint),
  instead of one completion per prompt scored by a reward function."""
  return isinstance(task, (EnvTask, AgentTask))


def episode_prompt(task, record) -> list[int]:
  """An episodic task's first prompt (token ids, BOS first) for a record."""
  return agent_prompt(task, record) if isinstance(task, AgentTask) else first_prompt(task, record)


def demonstration(task, record) -> tuple:
  """An episodic task's demonstration of a record -> (first prompt ids, the tokens after it, which
  of them are the model's)."""
  return agent_demo(task, record) if isinstance(task, AgentTask) else demo_tokens(task, record)


def prompt_lengths(task, records):
  """Token counts of the records' first prompts, as prompt_length counts them."""
  if isinstance(task, Task):
    return (prompt_length(task.tokenizer, r["prompt"]) for r in records)
  return (len(episode_prompt(task, r)) for r in records)


def prompt_length(tokenizer, prompt) -> int:
  """Tokens the rollout engine holds for a prompt (rollout.engine.Engine.submit): BOS and the text's
  tokens, or the token ids as given."""
  return 1 + len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)


def check_prompt_lengths(task: Task, max_prompt_len: int, eval_size: int):
  """Every prompt the engine will see (the train split, the eval split's first eval_size) fits
  rollout.max_prompt_len. The engine refuses a longer one only when its batch comes up, which may be
  hours into a run, so all are measured as the task loads."""
  too_long, longest = [], 0
  for split, records in (("train", task.train), ("eval", task.eval[:eval_size])):
    over = 0  # counted as the records stream by: a file-backed split is never a list here
    for n in prompt_lengths(task, records):
      if n > max_prompt_len:
        over, longest = over + 1, max(longest, n)
    if over:
      too_long.append(f"{over} of {len(records)} {split} prompts")
  if too_long:
    raise TaskError(f"rollout.max_prompt_len={max_prompt_len}: {' and '.join(too_long)} of task {task.name!r} are "
                    f"longer (up to {longest} tokens, BOS included); raise it, e.g. "
                    f"--config.rollout.max_prompt_len={longest} (the KV cache grows with it), or leave the long "
                    "records out of the task")
