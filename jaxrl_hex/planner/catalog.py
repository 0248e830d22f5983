"""Device catalog: per-chip speeds, memory, links and prices, from catalog.yaml plus overlays."""
import dataclasses
import pathlib

import yaml

from jaxrl_hex.planner import PlanError

CATALOG_PATH = pathlib.Path(__file__).with_name("catalog.yaml")

# What each required field means, so a missing one can be reported with its fix.
SPEC_FIELDS = {
    "platform": "tpu, gpu or cpu",
    "bf16_tflops": "dense bf16 peak per chip, TFLOP/s",
    "hbm_gb": "accelerator memory per chip, GB",
    "hbm_gb_s": "memory bandwidth per chip, GB/s",
    "link_gb_s": "NVLink/ICI bandwidth per chip, GB/s one direction",
    "host_net_gb_s": "the chip's share of host network bandwidth, GB/s",
    "price_per_hour": "USD per chip-hour",
    "chips_per_host": "chips in one host",
}
EFFICIENCY_FIELDS = ("train_mfu", "rollout_eff", "attention_eff", "train_overhead_s", "decode_overhead_s",
                     "rollout_overhead_s")
# Optional: the chip counts a slice of this type comes in (TPU topologies); a TPU runtime larger than
# one host must be one of them. Without the field a TPU type takes powers of two.
SLICE_FIELD = "slice_chips"
PLATFORMS = ("tpu", "gpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Device:
  name: str
  platform: str
  bf16_tflops: float
  hbm_gb: float
  hbm_gb_s: float
  link_gb_s: float
  host_net_gb_s: float
  price_per_hour: float
  chips_per_host: int
  train_mfu: float
  rollout_eff: float
  attention_eff: float
  train_overhead_s: float
  decode_overhead_s: float
  rollout_overhead_s: float  # fixed seconds per step a replica spends on a batch beyond its prefill and decode
  slice_chips: tuple = ()  # TPU: the slice sizes the type comes in (catalog `slice_chips`)

  @property
  def flops(self) -> float:
    return self.bf16_tflops * 1e12

  @property
  def hbm_bytes(self) -> float:
    return self.hbm_gb * 1e9

  @property
  def hbm_bw(self) -> float:
    return self.hbm_gb_s * 1e9

  def group_bw(self, group: int) -> float:
    """Bytes/s per chip for a collective over `group` consecutive chips of this type.

    A TPU slice is one ICI fabric, so any group rides ICI; GPU groups leave NVLink once
    they span more than one host.
    """
    if self.platform != "gpu" or group <= self.chips_per_host:
      return self.link_gb_s * 1e9
    return self.host_net_gb_s * 1e9

  def runtime_sizes_ok(self, n: int) -> bool:
    """Whether n chips of this type can form one JAX runtime (one mesh) as the platform deploys them:
    a GPU runtime takes whole hosts unless it is smaller than one; a TPU runtime is a slice of a
    shape the catalog names (or a part of one host); cpu devices are simulated, any count goes."""
    if self.platform == "gpu":
      return n < self.chips_per_host or n % self.chips_per_host == 0
    if self.platform == "tpu":
      sizes = self.slice_chips or tuple(2**k for k in range(16))
      return n in sizes or (n <= self.chips_per_host and n & (n - 1) == 0)
    return True


def _read_yaml(path) -> dict:
  try:
    data = yaml.safe_load(pathlib.Path(path).read_text()) or {}
  except FileNotFoundError:
    raise PlanError(f"catalog file {path} not found; pass an existing YAML path") from None
  except yaml.YAMLError as e:
    raise PlanError(f"catalog file {path} is not valid YAML ({str(e).splitlines()[0]})") from None
  return _checked(data, f"catalog file {path}")


def _checked(data, where) -> dict:
  if not isinstance(data, dict) or not isinstance(data.get("devices", {}), dict):
    raise PlanError(f"{where}: expected a mapping with a `devices:` mapping of entries")
  return data


def load_catalog(extra=None, prices=None) -> dict:
  """Built-in catalog, then `extra`: a YAML path, or a list of paths and (label, mapping) pairs,
  each the catalog's shape; later ones override fields or add entries. Then prices.

  Returns {name: Device}. Raises PlanError naming the entry and field when one is incomplete.
  """
  extras = [extra] if isinstance(extra, (str, pathlib.Path)) else [e for e in extra or () if e]
  sources = [(CATALOG_PATH, _read_yaml(CATALOG_PATH))]
  for e in extras:
    sources.append((e[0], _checked(e[1], e[0])) if isinstance(e, tuple) else (pathlib.Path(e), _read_yaml(e)))
  defaults, entries, origin = {}, {}, {}
  for path, data in sources:
    defaults.update(data.get("defaults") or {})
    for name, fields in data["devices"].items():
      if not isinstance(fields, dict):
        raise PlanError(f"catalog entry '{name}' in {path}: expected a mapping of fields")
      entries.setdefault(str(name), {}).update(fields)
      origin[str(name)] = path
  for name, price in (prices or {}).items():
    if name not in entries:
      raise PlanError(f"prices: unknown device type '{name}'; known: {', '.join(entries)}")
    entries[name]["price_per_hour"] = price
  return {name: _device(name, dict(defaults, **fields), origin[name]) for name, fields in entries.items()}


def _device(name, fields, path) -> Device:
  for field, meaning in list(SPEC_FIELDS.items()) + [(f, "efficiency factor") for f in EFFICIENCY_FIELDS]:
    if field not in fields:
      raise PlanError(f"catalog entry '{name}' in {path}: missing field '{field}' ({meaning}); add it to the entry")
  unknown = set(fields) - set(SPEC_FIELDS) - set(EFFICIENCY_FIELDS) - {SLICE_FIELD}
  if unknown:
    raise PlanError(f"catalog entry '{name}' in {path}: unknown field(s) {sorted(unknown)}; "
                    f"known: {sorted(SPEC_FIELDS) + list(EFFICIENCY_FIELDS) + [SLICE_FIELD]}")
  if fields["platform"] not in PLATFORMS:
    raise PlanError(f"catalog entry '{name}' in {path}: platform '{fields['platform']}' must be one of {PLATFORMS}")
  values = {"name": name, "platform": fields["platform"]}
  for field in list(SPEC_FIELDS)[1:] + list(EFFICIENCY_FIELDS):
    try:
      values[field] = float(fields[field])
    except (TypeError, ValueError):
      raise PlanError(f"catalog entry '{name}' in {path}: field '{field}' must be a number, "
                      f"got {fields[field]!r}") from None
    positive = field not in ("price_per_hour", "train_overhead_s", "decode_overhead_s", "rollout_overhead_s")
    if values[field] < 0 or (positive and values[field] == 0):
      raise PlanError(f"catalog entry '{name}' in {path}: field '{field}' must be "
                      f"{'> 0' if positive else '>= 0'}, got {fields[field]!r}")
  values["chips_per_host"] = int(values["chips_per_host"])
  sizes = fields.get(SLICE_FIELD) or []
  if not isinstance(sizes, list) or not all(isinstance(k, int) and k > 0 for k in sizes):
    raise PlanError(f"catalog entry '{name}' in {path}: field '{SLICE_FIELD}' must be a list of positive chip "
                    f"counts (the slice sizes the type comes in), got {sizes!r}")
  values[SLICE_FIELD] = tuple(sorted(sizes))
  return Device(**values)
