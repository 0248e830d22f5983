"""Model config files the planner reads: configs/models/NAME.py, whose get_config() returns a
models.config.model_config(...), and its LoRA setting (model.lora: the file's, or a plan's)."""
import pathlib

from jaxrl_hex.models.config import check_lora
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


def with_lora(cfg, rank: int, targets=None, where="--lora-rank"):
  """A copy of model config `cfg` with model.lora.rank (and .targets, when given) set, checked as
  the run checks them; rank 0 is full fine-tuning."""
  out = cfg.copy_and_resolve_references()
  try:
    out.lora.rank = rank
    if targets is not None:
      out.lora.targets = tuple(targets)
    check_lora(out)
  except (TypeError, ValueError) as e:
    raise PlanError(f"{where}: {e}") from None
  return out
