"""The attention kernels JAX ships (Pallas: Triton on GPU, Mosaic on TPU) where they compute what
models.attention's portable blockwise attention computes, and that portable path elsewhere.

Both kernels mask by one segment id per token and by index order: query t sees key s when their
ids are equal and s <= t. That is Segments' rule (equal ids > 0, the key's position not after the
query's, within the window) when
- the keys are the queries' own tokens, in order (Segments.causal with as many keys as queries:
  the trainer's packed and padded rows, a fresh prompt's prefill),
- positions increase along the row within each segment, so index order is position order there
  (packing, padding and prompts lay every sequence out in order), and
- there is no window; nor do the kernels take a soft-cap.
A query reading other keys (a completion attending its group's prompt cache, decode), sliding
layers and soft-capped scores keep the portable path. The kernels know no grouped-query
attention: the KV heads are repeated to the query heads. Rows are padded to a multiple of the
kernel's tile with id 0; the kernels let padding queries (id 0) see padding keys, so their
outputs are set to zeros, as the portable path gives queries that see nothing (their zero output
gradient then gives the padding keys none either). Both kernels have their own backward pass.

Under a mesh (a caller that entered models.sharding.activation_sharding, as the trainer and the
engine do) a kernel runs on each device's part in a shard_map over the batch and KV-head axes: XLA
cannot partition a kernel, and would gather its inputs whole onto every device.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention
from jax.sharding import PartitionSpec

from jaxrl_hex.models.attention import Segments, blockwise_attention
from jaxrl_hex.models.sharding import logical_sharding

GPU_TILE = 128  # the Triton kernel's tile: a power of two, [tile, head_dim] blocks held in SRAM
GPU_BACKWARD_TILE = 32  # the backward pass holds more per tile (JAX's defaults)
TPU_LANES = 128  # the Mosaic kernel's key tiles are multiples of the TPU's 128 lanes


def _gpu_tile(t, block):
  """The Triton kernel's tile for rows of t tokens: a power of two from 16 (its smallest matmul)
  up to GPU_TILE and the model's attention_block."""
  return max(16, min(GPU_TILE, 1 << (block.bit_length() - 1), 1 << (t - 1).bit_length()))


def _tpu_tile(t, block):
  """The Mosaic kernel's tile: the largest multiple of 128 up to attention_block that divides the
  row rounded up to 128."""
  lanes, most = -(-t // TPU_LANES), max(1, block // TPU_LANES)
  return TPU_LANES * max(d for d in range(1, min(lanes, most) + 1) if lanes % d == 0)


def _gpu_mha(q, k, v, segments, scale, tile, interpret):
  """q, k, v [B, H, T, hd], segments [B, T], T a multiple of tile -> [B, H, T, hd]."""
  back = min(GPU_BACKWARD_TILE, tile)
  sizes = gpu_attention.BlockSizes(block_q=tile, block_k=tile, block_q_dkv=back, block_kv_dkv=back, block_q_dq=back,
                                   block_kv_dq=back)
  out = gpu_attention.mha(*(x.swapaxes(1, 2) for x in (q, k, v)), segments, sm_scale=scale, causal=True,
                          block_sizes=sizes, interpret=interpret)  # the kernel's layout: [B, T, H, hd]
  return out.swapaxes(1, 2)


def _tpu_flash(q, k, v, segments, scale, tile):
  """As _gpu_mha. The Mosaic kernel has no interpret flag: a test runs it on CPU under
  jax.experimental.pallas.tpu.force_tpu_interpret_mode(), around the backward pass too."""
  sizes = tpu_attention.BlockSizes(block_q=tile, block_k_major=tile, block_k=tile, block_b=1, block_q_major_dkv=tile,
                                   block_k_major_dkv=tile, block_k_dkv=tile, block_q_dkv=tile, block_k_major_dq=tile,
                                   block_k_dq=tile, block_q_dq=tile)
  return tpu_attention.flash_attention(q, k, v, segment_ids=tpu_attention.SegmentIds(segments, segments), causal=True,
                                       sm_scale=scale, block_sizes=sizes)


def _self_attention(kernel, tile_for, block, scale, q, keys, values, segments):
  """q [B, KV, G, T, hd], keys [B, KV, hd, T], values [B, KV, T, hd] (models.attention's layout),
  segments [B, T] -> [B, KV, G, T, hd] by `kernel` over [B, H, T, hd] heads."""
  b, kv, g, t, hd = q.shape
  tile = tile_for(t, block)
  pad = -(-t // tile) * tile - t
  heads = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
  out = kernel(heads(q.reshape(b, kv * g, t, hd)), heads(jnp.repeat(keys.swapaxes(2, 3), g, axis=1)),
               heads(jnp.repeat(values, g, axis=1)), jnp.pad(segments, ((0, 0), (0, pad))), scale, tile)
  out = out[:, :, :t].reshape(q.shape)
  return jnp.where((segments > 0)[:, None, None, :, None], out, 0).astype(q.dtype)


def _mesh_split(q):
  """(mesh, PartitionSpec of the leading [B, KV] dims) that split q under the caller's activation
  sharding (the batch alone where the KV heads do not divide), or None without one."""
  for axes in (("batch", "kv_heads"), ("batch",)):
    sharding = logical_sharding(axes + (None,) * (q.ndim - len(axes)), q.shape)
    if sharding is not None:
      return sharding.mesh, PartitionSpec(*sharding.spec[:2])
  return None


def _on_each_device(fn, q, keys, values, segments):
  """fn(q, keys, values, segments) on each device's rows and KV heads (q, keys and values all lead
  with [B, KV]), or as it is outside a mesh."""
  split = _mesh_split(q)
  if split is None:
    return fn(q, keys, values, segments)
  mesh, spec = split
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(spec[0])), out_specs=spec,
                       check_vma=False)(q, keys, values, segments)


def kernel_for(platform: str, *, keys_are_queries: bool, cap: float, windowed: bool, head_dim: int, block: int,
               interpret: bool = False):
  """The platform kernel ("gpu": Triton, "tpu": Mosaic) as fn(q, keys, values, segments [B, T],
  scale) -> blockwise_attention's output, or None where it does not compute the same: keys other
  than the queries' own tokens, a soft-cap, a window, a TPU head_dim neither <= 128 nor a multiple
  of 128, any other platform. interpret: run the Triton kernel on CPU (tests)."""
  if not keys_are_queries or cap or windowed:
    return None
  if platform == "gpu":
    kernel, tile_for = functools.partial(_gpu_mha, interpret=interpret), _gpu_tile
  elif platform == "tpu" and (head_dim <= TPU_LANES or head_dim % TPU_LANES == 0):
    kernel, tile_for = _tpu_flash, _tpu_tile
  else:
    return None

  def attend(q, keys, values, segments, scale):
    return _on_each_device(functools.partial(_self_attention, kernel, tile_for, block, scale), q, keys, values,
                           segments)

  return attend


def attention(q, keys, values, mask: Segments, scale: float, cap: float, block: int, kernel: str, windowed: bool):
  """blockwise_attention(q, keys, values, mask, scale, cap, block), by the platform's kernel where
  `kernel` (model.attention_kernel) asks for it and it computes the same. windowed: the layer may
  slide (its window is not known when tracing). "auto" uses a kernel on GPU and TPU, and only under
  an activation sharding or on a single device (elsewhere XLA would run it whole on every device);
  "pallas" wherever it applies, on CPU the Triton kernel in interpret mode."""
  platform = jax.default_backend()
  if kernel == "auto":
    wanted = platform in ("gpu", "tpu") and (jax.device_count() == 1 or _mesh_split(q) is not None)
  else:
    wanted = kernel == "pallas"
  keys_are_queries = mask.keys_are_queries and keys.shape[3] == q.shape[3]  # a longer cache holds other keys
  fn = wanted and kernel_for("gpu" if platform == "cpu" else platform, keys_are_queries=keys_are_queries, cap=cap,
                             windowed=windowed, head_dim=q.shape[-1], block=block, interpret=platform == "cpu")
  if not fn:
    return blockwise_attention(q, keys, values, mask, scale, cap, block)
  return fn(q, keys, values, mask.q_segments, scale)
