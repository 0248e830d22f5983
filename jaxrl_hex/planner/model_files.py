"""Model config files the planner reads: configs/models/NAME.py, whose get_config() returns a
models.config.model_config(...)."""
import pathlib

from jaxrl_hex.planner import PlanError
from jaxrl_hex.specs import load_module

REPO = pathlib.Path(__file__).resolve().parents[2]


def load_model(arg):
  """configs/models/NAME.py or NAME -> (name, config); looks in ./configs/models then the repo's."""
  path = pathlib.Path(arg)
  if arg.endswith(".py"):
    candidates = [path]
  else:
    candidates = [pathlib.Path("configs/models") / f"{arg}.py", REPO / "configs/models" / f"{arg}.py"]
  found = next((c for c in candidates if c.is_file()), None)
  if found is None:
    raise PlanError(f"model '{arg}' not found (looked for {', '.join(map(str, candidates))}); "
                    f"pass configs/models/NAME.py or NAME")
  try:
    cfg = load_module(str(found), "--model").get_config()
  except AttributeError:
    raise PlanError(f"model file {found} has no get_config(); define one returning model_config(...)") from None
  except ValueError as e:
    raise PlanError(f"model file {found}: {e}") from None
  return found.stem, cfg
