"""The model config's "auto" fields: scan_layers follows the depth, dtype is the run's to choose."""
import pytest

from jaxrl_hex.models.config import SCAN_DEEPER_THAN, auto_dtype, auto_scan_layers, model_config


def test_scan_layers_auto_scans_deep_models_only():
  assert model_config(n_layers=2, scan_layers="auto").scan_layers is False  # the built-in demo: unrolled
  assert model_config(n_layers=SCAN_DEEPER_THAN, scan_layers="auto").scan_layers is False
  assert model_config(n_layers=30, scan_layers="auto").scan_layers is True  # SmolLM2's depth
  assert model_config(n_layers=30, scan_layers=False).scan_layers is False  # a value given stands
  assert [auto_scan_layers(n) for n in (8, 9)] == [False, True]


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_accelerators():
  assert [auto_dtype(p) for p in ("cpu", "gpu", "tpu")] == ["float32", "bfloat16", "bfloat16"]
  with pytest.raises(ValueError, match="dtype='auto' is chosen by a run as it starts"):
    model_config(dtype="auto")
  with pytest.raises(ValueError, match=r"scan_layers='yes'; use True, False or 'auto' \(scan from 9 layers\)"):
    model_config(scan_layers="yes")
