"""A ReAct agent, written against the `openai` client, trained on the calculator task.

The agent is a plain loop: ask the model, run the tool calls it makes, send back their results,
until it answers. Nothing in it knows about training: the rollout side hands it a client whose
base URL is its episode's endpoint, and every reply it gets is a model turn that is trained.

  jaxrl-hex train --config=configs/calculator_grpo.py --config.task=examples/react_calculator.py:make_agent \\
      --workdir=runs/react

The records, the tool and the warm start's demonstrations are the calculator task's
(jaxrl_hex/tasks/calculator.py): `12*34=` -> `<calc>12*34</calc>` -> `<result>408</result>` -> `408`.
"""
import json

from jaxrl_hex.tasks import calculator
from jaxrl_hex.tasks.agent import AgentTask

TOOLS = [calculator.calc.schema()]


def question(record) -> str:
  return calculator.Multiply().reset(record)  # "12*34="


def react(client, record, max_steps: int = 3) -> float:
  """One episode: the reward is 1 when the final answer is the product."""
  messages = [{"role": "user", "content": question(record)}]
  for _ in range(max_steps):
    reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))  # the reply goes back as it came
    if not reply.tool_calls:
      return float((reply.content or "").strip() == str(record["a"] * record["b"]))
    for call in reply.tool_calls:
      try:
        result = calculator.calc(**json.loads(call.function.arguments))
      except (TypeError, ValueError) as e:
        result = f"{type(e).__name__}: {e}"  # the model reads the error and may try again
      messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
  return 0.0


def demo(record) -> list:
  """The warm start's episode: the first call's messages, then the calculator task's demo."""
  return [([{"role": "user", "content": question(record)}], False)] + calculator.demo(record)


def make_agent(config) -> AgentTask:
  env = calculator.make_env(config)
  return AgentTask(name=f"react-{env.name}", train=env.train, eval=env.eval, agent=react, tools=env.tools,
                   tool_format="tags", tokenizer=env.tokenizer, demo=demo, max_turns=3)
