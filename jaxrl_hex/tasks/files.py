"""A task from your own files: JSONL, Parquet, Arrow/Feather, or a directory written by Hugging Face
datasets' save_to_disk (jaxrl_hex/data/files.py), with a field mapping.

task_args (ARGS has every field and its default):
- train_file / eval_file: paths, globs or save_to_disk directories, comma-separated; without an
  eval_file the first eval_size records of the train files are held out.
- prompt_field / answer_field: the columns (JSONL keys) holding the question and the reference.
- system_field (a column) or system_prompt (one text for all), instruction (a line after each
  prompt), chat_template: with config.model_dir, prompts become a user turn of the model's chat
  template; otherwise prompt_format ('{prompt}' and '{system}' stand for the texts) shapes them.
- reward: "exact" (the completion, stripped, equals the answer), "math" (the final numbers agree,
  as the GSM8K task scores; the reference is reduced to what follows '####', a \\boxed{} or its last
  number) or 'path/to/file.py:fn' with fn(prompt, completion, answer) -> float.
- alphabet: the character tokenizer's characters when there is no model_dir ("" = every character
  of both splits, one pass over the files).

Records are read and formatted on demand, so a split is never a list in memory; the prompt stream
shuffles, shards and resumes over them as over any task's.
"""
from jaxrl_hex.data.files import RecordError, Records, open_files
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.specs import load_object
from jaxrl_hex.tasks import Task, TaskError
from jaxrl_hex.tasks.arithmetic import exact_match
from jaxrl_hex.tasks.gsm8k import extract_answer, hf_tokenizer, math_reward, prompt_formatter

ARGS = dict(
    train_file="",
    eval_file="",  # "": hold out eval_size records of train_file
    eval_size=256,
    prompt_field="prompt",
    answer_field="answer",
    system_field="",
    system_prompt="",
    instruction="",
    chat_template=True,
    prompt_format="{prompt}",
    reward="exact",
    alphabet="",
    eos_token="")  # "" = the tokenizer's eos_token; a chat model may end turns with another
REWARDS = {"exact": exact_match, "math": math_reward}


def _reward(spec: str):
  if spec in REWARDS:
    return REWARDS[spec]
  if ":" not in spec:
    raise TaskError(f"task_args.reward={spec!r}: expected one of {sorted(REWARDS)} or 'path/to/file.py:fn'")
  return load_object(spec, "task_args.reward")


def make_task(config) -> Task:
  if "train_file" not in config.task_args:  # e.g. --config.task=files over the default config
    raise TaskError("task files: the config has no task_args.train_file; start from --config=configs/gsm8k_files.py "
                    "or set task_args to dict(jaxrl_hex.tasks.files.ARGS, ...) in your config file")
  args = dict(ARGS, **config.task_args)  # a resumed run's config.json keeps base_config()'s task_args too
  if not args["train_file"]:
    raise TaskError("task files: set --config.task_args.train_file to your data, e.g. data/train.parquet "
                    "(JSONL, Parquet, Arrow or a save_to_disk directory)")
  try:
    args["prompt_format"].format(prompt="", system="")
  except (KeyError, IndexError, ValueError) as e:
    raise TaskError(f"task_args.prompt_format={args['prompt_format']!r}: {e!r}; use {{prompt}} and {{system}} and "
                    "double other braces ({{{{ }}}})") from None
  if config.get("model_dir"):
    tokenizer = hf_tokenizer(config)
  else:  # None: Task builds one from every character of the records
    tokenizer = CharTokenizer(args["alphabet"]) if args["alphabet"] else None
  format_prompt = prompt_formatter(tokenizer, args, args["prompt_format"])
  reward = _reward(args["reward"])
  math = reward is math_reward
  fields = {f"task_args.{k}": args[k] for k in ("prompt_field", "answer_field", "system_field") if args[k]}
  prompt_key, answer_key, system_key = args["prompt_field"], args["answer_field"], args["system_field"]

  def record(row: dict) -> dict:
    text, answer = row[prompt_key], row[answer_key]
    if not isinstance(text, str):
      raise RecordError(f"{prompt_key!r} is {type(text).__name__}, not text (task_args.prompt_field)")
    if answer is None:
      raise RecordError(f"{answer_key!r} is empty (task_args.answer_field)")
    answer = str(answer)
    if math:
      answer = extract_answer(answer)
      if answer is None:
        raise RecordError(f"{answer_key!r} has no final number ('#### 42', \\boxed{{42}} or a last number)")
    if args["instruction"]:
      text = f"{text}\n{args['instruction']}"
    return {"prompt": format_prompt(text, row[system_key] if system_key else None), "answer": answer}

  train = Records(open_files(args["train_file"], "task_args.train_file", fields), record)
  if args["eval_file"]:
    evals = Records(open_files(args["eval_file"], "task_args.eval_file", fields), record)
  else:  # hold out the first eval_size records of the train files
    n = min(args["eval_size"], len(train) // 2)
    train, evals = train[n:], train[:n]
  return Task(name="files", train=train, eval=evals, reward=reward, tokenizer=tokenizer)
