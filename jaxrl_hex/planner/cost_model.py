"""Analytic cost model: train step, rollout replica, memory and weight-sync times for one model.

Every time is split into a roofline part (at efficiency 1), a communication part and a fixed
overhead, so calibration can fit the efficiency factors against measured runs linearly.
"""
import dataclasses
import math

from jaxrl_hex.models.config import is_sliding, kv_bytes_per_token, lora_targets, lora_weight_dims, param_count
from jaxrl_hex.planner import PlanError

# Fraction of HBM the planner fills: the rest is XLA scratch, fragmentation and runtime buffers.
MEMORY_HEADROOM = 0.9
# The decode step's copies of one layer's keys and values per slot, in units of that layer's K + V:
# XLA's memory analysis of the engine's decode program (fp32, where XLA:CPU keeps no upcast copies)
# gives 1.50-1.51 for Qwen2-1.5B and -7B at 1.3k and 5k tokens per slot wherever the tensor degree
# is below the KV heads (at one KV head per device XLA:CPU's fp32 program copies the whole cache:
# benchmarks/README.md; benchmarks/compile_sizes.py --part decode).
DECODE_KV_COPIES = 1.5
# The train step's memory beyond its state, per device, fitted to XLA's compiled figures for the
# real step (benchmarks/compile_sizes.py --part fit: Qwen2 1.5B, 7B and 14B and Llama-3.1-70B on 8
# to 32 devices, 2k-16k tokens, tensor 1-4, each remat policy, with and without sequence
# parallelism; 33 points, each within 10%): bytes
# per element of the output head as a device holds it (vocab x d_model / tensor: the head
# gathered over fsdp, its gradient summed over the logprob chunks, and their fp32 copies), per
# sharded parameter (the optimizer update's temporaries), and per token and layer, for what the
# backward pass keeps of each layer under each model.remat policy: bytes per unit of d_model (the
# residual stream, whole on every tensor device) and per unit of mlp_dim / tensor (the MLP's
# activations, split). XLA:CPU is the compiler here (it upcasts bf16 matmuls to fp32), so the
# figures are a proxy for TPU and GPU, on the safe side.
HEAD_BYTES = 15.3
OPT_TEMP_BYTES = 3.1
SAVED_BYTES = {"none": (32.3, 26.3), "dots": (9.6, 10.1), "full": (5.7, 0.0)}
# Under remat full with sequence parallelism (TrainLayout.sequence_parallel), what the backward
# pass keeps per token and layer is the block input split over the tensor devices: bytes per unit
# of d_model / tensor, fitted to its own points. Under the other policies the saved dot outputs
# do not all split, so the planner counts them as without it (an upper bound, by XLA's figures).
SP_SAVED_BYTES = 7.75
# With LoRA under remat "dots" XLA's peak holds, beyond the terms above, about this many bytes
# per element of the adapted projections' outputs, per token and layer, split over tensor as
# those outputs are (whole for o_proj and down_proj, whose output is the residual stream): 3.6-4.1
# on three all-projection points of benchmarks/lora_memory.py (an fp32 [tokens, out] per adapted
# projection; not the saveable (xA)B product alone: excluding it from the policy left the peak as
# it was). "none" and "full" need no such term: the saved terms above are within 6% there.
LORA_DOTS_SAVED_BYTES = 4.0
RESIDUAL_OUTPUTS = ("self_attn.o_proj", "mlp.down_proj")
# The platform attention kernels (models.kernels: Triton on GPU, Mosaic on TPU) know no grouped-query
# attention: they take the KV heads repeated to the query heads, and without remat the backward
# pass keeps their inputs, so beyond what the portable path keeps (SAVED_BYTES) a kernel layer
# holds 2 x (heads - kv_heads) x head_dim more activation elements per token, split over tensor.
# Analytic: XLA:CPU runs the kernels only in interpret mode, so no compiled figure backs this term.
# Under remat "dots" and "full" attention is recomputed in the backward pass and the repeat lives
# one layer at a time.
TPU_KERNEL_HEAD_DIM = 128  # the Mosaic kernel takes head_dim <= 128 or a multiple of it (kernels.kernel_for)
# The fit's largest under-estimate (-10%): a layout fits when its estimate times 1 + this margin
# fits, so no fitted point the planner would pass overflows.
TRAIN_MEMORY_MARGIN = 0.11
# Extra forward FLOPs per parameter and token each policy recomputes in the backward pass
# ("dots" recomputes only elementwise work and attention, which attn_flops counts).
RECOMPUTE_FLOPS = {"none": 0.0, "dots": 0.0, "full": 2.0}
RECOMPUTES_ATTENTION = {"none": 0, "dots": 1, "full": 1}
REMATS = ("none", "dots", "full")  # least recompute first
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# LoRA adapters are float32 whatever model.param_dtype is (models/lora.py), and so are their
# gradients and Adam's moments.
ADAPTER_BYTES = 4
OUTPUT_DISTS = ("fixed", "lognormal", "uniform")
LORA_SERVING = ("unmerged", "merged")


def dtype_bytes(name) -> int:
  if name not in DTYPE_BYTES:
    raise PlanError(f"model config: dtype '{name}' unknown to the planner; use one of {sorted(DTYPE_BYTES)}")
  return DTYPE_BYTES[name]


@dataclasses.dataclass(frozen=True)
class Workload:
  """One RL step: batch_size prompts x group_size samples, and the async-loop knobs."""
  batch_size: int = 64  # prompts per trainer step
  group_size: int = 8  # samples per prompt (GRPO group)
  prompt_len: int = 1024
  output_mean: float = 4096.0  # mean generated tokens per sample
  output_max: int = 16384  # a KV slot must hold prompt + output_max
  output_dist: str = "lognormal"  # fixed | lognormal | uniform; shapes the simulator's lengths
  output_sigma: float = 0.6  # lognormal shape
  eta: int = 4  # max staleness; 0 = synchronous
  reward_s: float = 1.0  # reward computation per step, a constant
  max_concurrency: int = 256  # the engine's cap on sequences decoded together per replica

  @property
  def sequences(self) -> int:
    return self.batch_size * self.group_size

  @property
  def trained_tokens(self) -> float:
    return self.sequences * (self.prompt_len + self.output_mean)

  @classmethod
  def from_dict(cls, d, where="workload") -> "Workload":
    d = dict(d or {})
    out = d.pop("output_len", None)
    if isinstance(out, dict):  # output_len: {mean, max, dist, sigma}
      for key in ("mean", "max", "dist", "sigma"):
        if key in out:
          d[f"output_{key}"] = out.pop(key)
      if out:
        raise PlanError(f"{where}.output_len: unknown key(s) {sorted(out)}; use mean, max, dist, sigma")
    elif out is not None:
      d["output_mean"] = out
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(fields)
    if unknown:
      raise PlanError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)} (or output_len)")
    try:
      w = cls(**{k: type(fields[k].default)(v) for k, v in d.items()})
    except (TypeError, ValueError) as e:
      raise PlanError(f"{where}: bad value ({e})") from None
    if w.output_dist not in OUTPUT_DISTS:
      raise PlanError(f"{where}.output_len.dist: '{w.output_dist}' must be one of {OUTPUT_DISTS}")
    if min(w.batch_size, w.group_size, w.prompt_len, w.output_mean, w.max_concurrency) <= 0 or w.eta < 0:
      raise PlanError(f"{where}: sizes must be positive and eta >= 0")
    if w.output_max < w.output_mean:
      raise PlanError(f"{where}.output_len: max {w.output_max} is below mean {w.output_mean}; raise max")
    return w


@dataclasses.dataclass(frozen=True)
class ModelCost:
  """The shape facts the cost model needs, derived once from a model config."""
  params: int
  weight_bytes: float  # all parameters in param dtype
  layer_weight_bytes: float  # one decoder layer's parameters in param dtype
  kv_bytes_token: int  # KV cache per token over all layers
  act_bytes: int  # activation dtype size
  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  vocab: int
  # LoRA (model.lora.rank > 0): only the adapters train, hold optimizer state and sync; the base is
  # frozen. Every adapted projection has one d_model side (split over fsdp by meshes.DEFAULT_RULES)
  # and one heads / MLP side (split over tensor), and so has each of its factors A and B.
  lora_rank: int = 0
  lora_targets: tuple = ()  # PEFT names of the adapted projections (models.config.LORA_TARGETS)
  adapter_embed_params: int = 0  # adapter elements along d_model, over all layers
  adapter_wide_params: int = 0  # adapter elements along heads x head_dim or mlp_dim
  targeted_bytes: float = 0.0  # the adapted projections' weights in param dtype (a merged copy)
  adapted_out_embed: int = 0  # per token and layer: the adapted projections' output elements along d_model
  adapted_out_wide: int = 0  # ... along heads x head_dim or mlp_dim
  merged_serving: bool = False  # replicas fold the adapters into a copy of those weights (LoRA only)
  kernel_layers: int = 0  # layers whose training attention may run a platform kernel (kernel_saved_bytes)

  @classmethod
  def from_config(cls, cfg, lora_serving="unmerged") -> "ModelCost":
    """lora_serving: with LoRA, how rollout replicas apply the adapters (rollout.lora_serving):
    "unmerged" beside the base, or "merged" into a copy of the adapted weights."""
    if lora_serving not in LORA_SERVING:
      raise PlanError(f"lora serving '{lora_serving}' unknown; use one of {LORA_SERVING} (rollout.lora_serving)")
    act = dtype_bytes(cfg.dtype)
    p, pbytes = param_count(cfg), dtype_bytes(cfg.param_dtype)
    layer = (p - cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2) - cfg.d_model) / cfg.n_layers
    return cls(params=p, weight_bytes=p * pbytes, layer_weight_bytes=layer * pbytes,
               kv_bytes_token=kv_bytes_per_token(cfg, act), act_bytes=act, n_layers=cfg.n_layers, d_model=cfg.d_model,
               n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, mlp_dim=cfg.mlp_dim,
               vocab=cfg.vocab_size, kernel_layers=_kernel_layers(cfg), **_lora_fields(cfg, pbytes, lora_serving))

  @property
  def lora(self) -> bool:
    return bool(self.lora_rank)

  @property
  def adapter_params(self) -> int:
    return self.adapter_embed_params + self.adapter_wide_params

  @property
  def adapter_bytes(self) -> float:
    return ADAPTER_BYTES * self.adapter_params

  @property
  def trained_bytes(self) -> float:
    """The trained parameters: the adapters (fp32) with LoRA, else every weight. What one weight
    sync moves, and the size of their gradients."""
    return self.adapter_bytes if self.lora else self.weight_bytes

  def adapter_shard(self, fsdp: int, tensor: int) -> float:
    """Adapter elements one chip holds on a mesh of these fsdp and tensor degrees."""
    return self.adapter_embed_params / fsdp + self.adapter_wide_params / tensor

  def attn_flops(self, tokens, context) -> float:
    """Forward attention-score FLOPs (QK^T and AV) for `tokens` each attending `context` keys."""
    return 4.0 * self.n_layers * self.n_heads * self.head_dim * tokens * context


def _kernel_layers(cfg) -> int:
  """Layers whose packed training rows model.attention_kernel lets a platform kernel attend
  (models.kernels.attention): none under "portable" or a soft-cap; full (not sliding) layers
  otherwise, and none when scanned layers mix in sliding ones (a scanned layer's window is
  not known when it is traced)."""
  full = [not is_sliding(cfg, i) for i in range(cfg.n_layers)]
  if cfg.attention_kernel == "portable" or cfg.attn_logit_softcap or (cfg.scan_layers and not all(full)):
    return 0
  return sum(full)


def kernel_saved_bytes(m: ModelCost, layout, platform: str) -> float:
  """Bytes per token the platform kernels' repeated KV heads add to a train step (the comment above
  TPU_KERNEL_HEAD_DIM): 0 off GPU and TPU, under remat, or without grouped-query heads."""
  tpu_ok = m.head_dim <= TPU_KERNEL_HEAD_DIM or m.head_dim % TPU_KERNEL_HEAD_DIM == 0
  if layout.remat != "none" or platform not in ("gpu", "tpu") or (platform == "tpu" and not tpu_ok):
    return 0.0
  return 2.0 * (m.n_heads - m.n_kv_heads) * m.head_dim * m.act_bytes / layout.tensor * m.kernel_layers


def _lora_fields(cfg, pbytes: int, lora_serving: str) -> dict:
  """ModelCost's LoRA fields of a model config (all zero at rank 0: no projection is adapted)."""
  targets, r, dims, d = lora_targets(cfg), cfg.lora.rank, lora_weight_dims(cfg), cfg.d_model
  return dict(lora_rank=r if targets else 0, lora_targets=targets,
              adapter_embed_params=cfg.n_layers * r * d * len(targets),
              adapter_wide_params=cfg.n_layers * r * sum(sum(dims[n]) - d for n in targets),
              targeted_bytes=cfg.n_layers * pbytes * sum(dims[n][0] * dims[n][1] for n in targets),
              adapted_out_embed=sum(dims[n][1] for n in targets if n in RESIDUAL_OUTPUTS),
              adapted_out_wide=sum(dims[n][1] for n in targets if n not in RESIDUAL_OUTPUTS),
              merged_serving=bool(targets) and lora_serving == "merged")


@dataclasses.dataclass(frozen=True)
class TimeParts:
  roofline_s: float  # at efficiency 1
  comm_s: float
  efficiency: float
  overhead_s: float
  attention_s: float = 0.0  # decode only: the attention kernels' roofline, at attention_eff
  attention_eff: float = 1.0

  @property
  def total_s(self) -> float:
    return self.roofline_s / self.efficiency + self.attention_s / self.attention_eff + self.comm_s + self.overhead_s


def _collective_bytes(payload, group) -> float:
  """Per-chip traffic of a ring all-gather or reduce-scatter of `payload` bytes over `group` chips."""
  return payload * (group - 1) / group


# ---------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class TrainLayout:
  data: int
  fsdp: int
  tensor: int
  remat: str = "none"  # the model.remat policy the step runs with
  # Megatron-style sequence parallelism: the residual stream between blocks split over the
  # sequence on the tensor devices (the pool's rules map `length` to tensor), so what the
  # backward pass keeps of it shrinks by the tensor degree; the activation all-reduces become an
  # all-gather and a reduce-scatter of the same bytes.
  sequence_parallel: bool = False

  @property
  def devices(self) -> int:
    return self.data * self.fsdp * self.tensor

  def mesh(self) -> dict:
    return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

  def rules(self) -> dict:
    """The train pool's rules beyond meshes.DEFAULT_RULES that this layout needs."""
    return {"length": "tensor"} if self.sequence_parallel else {}


def train_memory(m: ModelCost, layout: TrainLayout, seq_len: int, rows: int = 1, platform: str = "cpu") -> float:
  """Peak bytes per chip of a train step whose micro-batch puts `rows` rows of `seq_len` tokens on
  each batch shard: params, gradients and Adam's two moments (all in param dtype, as optax keeps
  them) sharded over fsdp x tensor, plus the fitted terms above, plus the attention kernels'
  repeated KV heads on the `platform` that runs them (kernel_saved_bytes). With LoRA the base is frozen
  (its params alone, no gradient or moments) and the fp32 adapters carry all four and the
  optimizer's temporaries; the backward pass still keeps the activations through the frozen
  weights, so the saved terms are the same (under remat "dots" plus LORA_DOTS_SAVED_BYTES)."""
  shards, t = layout.fsdp * layout.tensor, layout.tensor
  if m.lora:
    trained = m.adapter_shard(layout.fsdp, t)
    state = m.weight_bytes / shards + 4 * ADAPTER_BYTES * trained
  else:
    trained = m.params / shards
    state = 4 * m.weight_bytes / shards
  head = HEAD_BYTES * m.vocab * m.d_model / t
  per_d, per_mlp = SAVED_BYTES[layout.remat]
  if layout.sequence_parallel and layout.remat == "full":
    per_d = SP_SAVED_BYTES / t
  per_token = per_d * m.d_model + per_mlp * m.mlp_dim / t
  if m.lora and layout.remat == "dots":
    per_token += LORA_DOTS_SAVED_BYTES * (m.adapted_out_embed + m.adapted_out_wide / t)
  saved = (per_token * m.n_layers + kernel_saved_bytes(m, layout, platform)) * rows * seq_len
  return state + head + OPT_TEMP_BYTES * trained + saved


def train_fits(m: ModelCost, dev, layout: TrainLayout, seq_len: int, rows: int = 1) -> bool:
  """Whether the step fits the chip's usable memory (MEMORY_HEADROOM) with the fit's margin."""
  need = train_memory(m, layout, seq_len, rows, dev.platform)
  return need * (1 + TRAIN_MEMORY_MARGIN) <= MEMORY_HEADROOM * dev.hbm_bytes


def train_time(m: ModelCost, dev, layout: TrainLayout, tokens: float, seq_len: int) -> TimeParts:
  """One trainer step over `tokens` tokens in sequences of `seq_len`.

  FLOPs per token: 6N for forward+backward plus 2N for the proximal-logprob forward pass the
  decoupled PPO loss needs, plus causal attention for each of those passes, plus what the remat
  policy recomputes. With LoRA the backward pass computes no weight gradient of a frozen weight
  (autodiff differentiates the adapters alone), only the activation gradients through it: 4N
  for forward+backward of the base's matmuls, and 6 per adapter parameter (A and B are matmuls
  too, with their weight gradients) in every pass beside them.
  """
  n = layout.devices
  per_pass = m.params + m.adapter_params  # 2 FLOPs each per token and pass: forward, or activation gradients
  trained = m.adapter_params if m.lora else m.params  # 2 more each: weight gradients
  flops = tokens * ((6.0 + RECOMPUTE_FLOPS[layout.remat]) * per_pass + 2.0 * trained)
  flops += (4 + RECOMPUTES_ATTENTION[layout.remat]) * m.attn_flops(tokens, seq_len / 2)
  roofline = flops / (n * dev.flops)
  t, f, d = layout.tensor, layout.fsdp, layout.data
  shard, grads = (m.weight_bytes + m.adapter_bytes) / t, m.trained_bytes / t
  # FSDP: gather params for forward and backward, reduce-scatter grads (once per step:
  # micro-batches reuse the gathered layer); data parallel: all-reduce the grad shards.
  comm = (2 * _collective_bytes(shard, f) + _collective_bytes(grads, f)) / dev.group_bw(f * t)
  comm += 2 * _collective_bytes(grads / f, d) / dev.group_bw(n)
  # Tensor parallel: 2 activation all-reduces per layer in each of forward, backward and
  # the proximal forward, over the tokens this tensor group processes.
  act = tokens / (d * f) * m.d_model * m.act_bytes
  comm += 6 * m.n_layers * 2 * _collective_bytes(act, t) / dev.group_bw(t)
  return TimeParts(roofline, comm, dev.train_mfu, dev.train_overhead_s)


def tensor_shards(m: ModelCost, t: int) -> bool:
  """Whether tensor degree t shards the model as meshes.DEFAULT_RULES lay it out: tensor splits
  heads, KV heads, the MLP and the vocabulary."""
  return not any(dim % t for dim in (m.n_heads, m.n_kv_heads, m.mlp_dim, m.vocab))


def train_layouts(m: ModelCost, dev, n: int, seq_len: int, sequences: int | None = None):
  """Layouts of n chips that fit in memory and that the runtime accepts (meshes.DEFAULT_RULES:
  fsdp splits d_model; tensor splits heads, KV heads, MLP and vocab, inside one host; the batch
  splits over data x fsdp, which must divide `sequences`, a step's batch, when given), each mesh
  with the least recomputing remat policy that fits it, and sequence parallelism (with remat
  full) only where the mesh fits nothing else: it costs no FLOPs, but XLA's partitioner lays
  some of its backward pass out less well."""
  for t in _divisors(n):
    if t > dev.chips_per_host or not tensor_shards(m, t):
      continue
    for f in _divisors(n // t):
      if m.d_model % f or (sequences is not None and sequences % (n // t)):
        continue
      knobs = [(remat, False) for remat in REMATS] + [("full", True)] * (t > 1)
      fitting = (TrainLayout(n // (t * f), f, t, remat, sp) for remat, sp in knobs)
      layout = next((x for x in fitting if train_fits(m, dev, x, seq_len)), None)
      if layout is not None:
        yield layout


def micro_batch_rows(m: ModelCost, dev, layout: TrainLayout, seq_len: int, per_shard: int) -> int:
  """Rows of seq_len tokens per batch shard in one micro-batch: the most, up to a step's
  `per_shard` sequences, in powers of two, whose step fits (1 when only one does)."""
  rows = 1
  while rows * 2 <= per_shard and train_fits(m, dev, layout, seq_len, rows * 2):
    rows *= 2
  return rows


def _divisors(n):
  return [k for k in range(1, n + 1) if n % k == 0]


# ---------------------------------------------------------------- rollout


@dataclasses.dataclass(frozen=True)
class Replica:
  """One inference replica: `tensor` chips of one type serving up to `slots` sequences at once.

  A decode step over c running sequences takes step_fixed_s + step_per_seq_s * c (the chord
  of decode_time between c = 1 and c = slots: weights read once, KV read per sequence).
  """
  device_type: str
  tensor: int
  slots: int
  prefill: TimeParts  # one prompt; it stalls the replica's decoding
  step_fixed_s: float
  step_per_seq_s: float
  batch_overhead_s: float = 0.0  # per step, beside prefill and decode (catalog rollout_overhead_s)

  def load_coeffs(self, w: Workload):
    """(a, b, c) with: time for one replica to generate n sequences of one step = max(a + b*n, c*n).

    The staleness gate lets about eta + 1 steps of sequences be in flight, so a replica given n
    per step runs c(n) = min(slots, (eta + 1) * n) at once; each sequence costs its share of its
    prompt's prefill (a prompt's G samples stay on one replica and share it) and output_mean
    decode steps of (fixed + per_seq * c) / c of the replica. Below saturation the weight read is
    shared by few sequences (the `a` term); at saturation it is spread over slots.
    """
    length, inflight, prefill = w.output_mean, w.eta + 1, self.prefill.total_s / w.group_size
    a = length * self.step_fixed_s / inflight
    b = prefill + length * self.step_per_seq_s
    c = prefill + length * (self.step_fixed_s / self.slots + self.step_per_seq_s)
    return a, b, c

  def tokens_per_s(self, w: Workload) -> float:
    """Generated tokens/s with every slot busy."""
    return w.output_mean / self.load_coeffs(w)[2]


def _kv_per_chip(m: ModelCost, tensor: int) -> float:
  # KV heads shard over tensor (a replica's tensor degree divides them).
  return m.kv_bytes_token / min(tensor, m.n_kv_heads)


def _adapters_served(m: ModelCost) -> bool:
  """Whether a replica computes with the adapters beside the base (LoRA, not merged)."""
  return m.lora and not m.merged_serving


def weight_read_bytes(m: ModelCost, tensor: int) -> float:
  """Weight bytes per chip a replica's forward pass reads: the base's shard (merged, with the
  adapted weights' merged copy in place of theirs), and unmerged adapters beside it."""
  return m.weight_bytes / tensor + (ADAPTER_BYTES * m.adapter_shard(1, tensor) if _adapters_served(m) else 0.0)


def resident_weight_bytes(m: ModelCost, tensor: int) -> float:
  """Weight bytes per chip a replica holds: what it reads and, serving merged, the base's adapted
  weights beside their merged copy (a sync moves adapters only, folded into the base again)."""
  return weight_read_bytes(m, tensor) + (m.targeted_bytes / tensor if m.lora and m.merged_serving else 0.0)


def _served_params(m: ModelCost) -> int:
  return m.params + (m.adapter_params if _adapters_served(m) else 0)


def kv_capacity(m: ModelCost, dev, tensor: int) -> float:
  """Bytes per chip left for KV cache after the weights (resident_weight_bytes)."""
  return MEMORY_HEADROOM * dev.hbm_bytes - resident_weight_bytes(m, tensor)


def decode_time(m: ModelCost, dev, tensor: int, batch: int, context: float) -> TimeParts:
  """One decode step of `batch` sequences at mean `context`: the weight matmuls (weights read
  over HBM, or their FLOPs once the batch is large enough) and then attention (the KV cache
  read, or its FLOPs) -- two kernel classes one after the other, each at its own roofline and
  efficiency -- plus 2 tensor all-reduces and a fixed launch overhead per layer."""
  matmuls = max(weight_read_bytes(m, tensor) / dev.hbm_bw, 2.0 * _served_params(m) * batch / tensor / dev.flops)
  attention = max(batch * context * _kv_per_chip(m, tensor) / dev.hbm_bw,
                  m.attn_flops(batch, context) / tensor / dev.flops)
  act = batch * m.d_model * m.act_bytes
  comm = 2 * m.n_layers * 2 * _collective_bytes(act, tensor) / dev.group_bw(tensor)
  return TimeParts(matmuls, comm, dev.rollout_eff, dev.decode_overhead_s * m.n_layers, attention, dev.attention_eff)


def prefill_time(m: ModelCost, dev, tensor: int, prompt_len: int) -> TimeParts:
  """One prompt's prefill: compute bound (weights are read once for the whole prompt)."""
  flops = (2.0 * _served_params(m) * prompt_len + m.attn_flops(prompt_len, prompt_len / 2)) / tensor
  roofline = max(flops / dev.flops, weight_read_bytes(m, tensor) / dev.hbm_bw)
  act = prompt_len * m.d_model * m.act_bytes
  comm = 2 * m.n_layers * 2 * _collective_bytes(act, tensor) / dev.group_bw(tensor)
  return TimeParts(roofline, comm, dev.rollout_eff, dev.decode_overhead_s)


def decode_working_bytes(m: ModelCost, tensor: int, slots: int, span: int) -> float:
  """What the engine's decode step holds per chip beside the weights and the KV cache: the layer
  scan's copy of one layer's weights, and DECODE_KV_COPIES of one layer's keys and values over the
  `span` tokens a decode call attends to, for every slot."""
  return m.layer_weight_bytes / tensor + DECODE_KV_COPIES * slots * span * _kv_per_chip(m, tensor) / m.n_layers


def replica(m: ModelCost, dev, tensor: int, w: Workload):
  """The replica of `tensor` chips of `dev`, or None when one max-length sequence does not fit.

  Slots are sized for mean-length sequences (paged KV pays for tokens actually held), while
  feasibility demands room for one sequence of prompt + output_max; the decode step's working
  set (decode_working_bytes) spans the longest sequence in flight, so it is sized for output_max.
  """
  if not tensor_shards(m, tensor) or tensor > dev.chips_per_host:
    return None
  kv, span = _kv_per_chip(m, tensor), w.prompt_len + w.output_max
  room = kv_capacity(m, dev, tensor) - decode_working_bytes(m, tensor, 0, span)
  working = decode_working_bytes(m, tensor, 1, span) - decode_working_bytes(m, tensor, 0, span)  # per slot
  if room < kv * span + working:
    return None
  slots = int(min(w.max_concurrency, room // (kv * (w.prompt_len + w.output_mean) + working)))
  slots = max(slots, 1)
  context = w.prompt_len + w.output_mean / 2  # a running sequence is half-way on average
  one, full = (decode_time(m, dev, tensor, c, context).total_s for c in (1, slots))
  per_seq = (full - one) / (slots - 1) if slots > 1 else 0.0
  return Replica(dev.name, tensor, slots, prefill_time(m, dev, tensor, w.prompt_len), one - per_seq, per_seq,
                 dev.rollout_overhead_s)


def tensor_degrees(dev):
  """TP degrees a replica may use on this device: powers of two inside one host."""
  return [2**k for k in range(int(math.log2(dev.chips_per_host)) + 1)]


# ---------------------------------------------------------------- weight sync


def sync_bw(src, dst, same_fabric: bool) -> float:
  """Bytes/s per chip between a train chip of `src` and a rollout chip of `dst`.

  Chips of one type on one fabric (a TPU slice, or one GPU host) use the fast link;
  everything else, TPU<->GPU and across GPU generations included, goes over the host network.
  """
  if src.name == dst.name and same_fabric:
    return src.link_gb_s * 1e9
  return min(src.host_net_gb_s, dst.host_net_gb_s) * 1e9


def sync_send_time(m: ModelCost, n_train: int, bw: float) -> float:
  """Trainer side of a weight sync: the pool pushes one copy of m.trained_bytes (the weights, or with
  LoRA the adapters) out at its aggregate bandwidth (replicas relay it onward, so more replicas
  do not add to the sender's share)."""
  return m.trained_bytes / (n_train * bw)


def sync_recv_time(m: ModelCost, tensor: int, bw: float) -> float:
  """Rollout side: each replica chip takes its shard, pausing generation: 1/tensor of the weights,
  or with LoRA the adapters as a replica holds them (their d_model side whole on every chip)."""
  chip = ADAPTER_BYTES * m.adapter_shard(1, tensor) if m.lora else m.weight_bytes / tensor
  return chip / bw
