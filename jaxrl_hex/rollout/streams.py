"""The stream a rollout replica runs its chunks through, by the kind of task."""
from jaxrl_hex.rollout.agents import AgentStream
from jaxrl_hex.rollout.episodes import EpisodeStream
from jaxrl_hex.rollout.stream import ChunkStream
from jaxrl_hex.tasks import AgentTask, EnvTask


def make_stream(engine, task, turn_tokens: int = 0):
  """Prompt groups (ChunkStream, submit takes prompts), or episodes of an environment
  (EpisodeStream) or of an agent on the OpenAI endpoint (AgentStream), whose submit takes records."""
  if isinstance(task, AgentTask):
    return AgentStream(engine, task, turn_tokens)
  if isinstance(task, EnvTask):
    return EpisodeStream(engine, task, turn_tokens)
  return ChunkStream(engine)
