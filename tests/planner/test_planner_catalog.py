"""Device catalog: built-in entries, overlays, price overrides and clear errors."""
import pytest

from jaxrl_hex.planner import PlanError
from jaxrl_hex.planner.catalog import load_catalog


def test_builtin_catalog_has_every_required_device():
  cat = load_catalog()
  for name in ["v4", "v5e", "v5p", "v6e", "A100", "H100", "H200", "H800", "H20", "L4", "B200", "cpu"]:
    assert name in cat
  # The AReaL-Hex figures, as that paper states them.
  assert (cat["H20"].bf16_tflops, cat["H20"].hbm_gb_s, cat["H20"].hbm_gb, cat["H20"].price_per_hour) == (148, 4000, 96,
                                                                                                         1.85)
  assert (cat["H800"].bf16_tflops, cat["H800"].hbm_gb_s, cat["H800"].hbm_gb, cat["H800"].price_per_hour) == (756, 2000,
                                                                                                             80, 5.28)
  assert cat["v5e"].platform == "tpu" and cat["H100"].platform == "gpu"
  assert cat["H100"].train_mfu == 0.40  # filled from the defaults section


def test_overlay_overrides_and_adds(tmp_path):
  extra = tmp_path / "extra.yaml"
  extra.write_text("""
devices:
  H800: {hbm_gb_s: 3350}
  MI300X: {platform: gpu, bf16_tflops: 1307, hbm_gb: 192, hbm_gb_s: 5300, link_gb_s: 448,
           host_net_gb_s: 50, price_per_hour: 3.5, chips_per_host: 8}
""")
  cat = load_catalog(extra, prices={"H20": 2.0})
  assert cat["H800"].hbm_gb_s == 3350 and cat["H800"].bf16_tflops == 756
  assert cat["MI300X"].hbm_gb == 192 and cat["MI300X"].rollout_eff == 0.60
  assert cat["H20"].price_per_hour == 2.0


def test_missing_field_names_entry_field_and_fix(tmp_path):
  extra = tmp_path / "extra.yaml"
  extra.write_text("devices:\n  X1: {platform: gpu, bf16_tflops: 100, hbm_gb: 10, link_gb_s: 1,"
                   " host_net_gb_s: 1, price_per_hour: 1, chips_per_host: 8}\n")
  with pytest.raises(PlanError) as e:
    load_catalog(extra)
  msg = str(e.value)
  assert "'X1'" in msg and "'hbm_gb_s'" in msg and "add it" in msg and "\n" not in msg


def test_bad_values_and_unknown_price_type(tmp_path):
  extra = tmp_path / "extra.yaml"
  extra.write_text("devices:\n  H100: {hbm_gb: -1}\n")
  with pytest.raises(PlanError, match="'hbm_gb' must be > 0"):
    load_catalog(extra)
  with pytest.raises(PlanError, match="unknown device type 'H900'"):
    load_catalog(prices={"H900": 1.0})
  extra.write_text("devices:\n  v5e: {slice_chips: [4, x]}\n")
  with pytest.raises(PlanError, match="'v5e'.*'slice_chips' must be a list of positive chip counts"):
    load_catalog(extra)
