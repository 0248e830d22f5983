"""The logprob probe's verdict: a gap within tolerance passes; above it, the message names the
version, the token and, from the two sides' fingerprints, the leaf or the program."""
import numpy as np
import pytest

from jaxrl_hex.sync.fingerprint import SyncMismatch
from jaxrl_hex.sync.probe import check

SAME = {"['embed']": (1.0, 2.0, 3.0, 4.0), "['lm_head']": (5.0, 6.0, 7.0, 8.0)}


def test_a_gap_within_tolerance_passes_and_reports_the_largest_gap():
  asked = []
  gap = check(4, np.array([-0.5, -1.0, -2.0]), np.array([-0.5, -1.004, -1.999]), 0.01, lambda: asked.append(1))
  assert gap == pytest.approx(0.004)
  assert not asked  # the fingerprints are fetched only on a mismatch


def test_a_mismatch_names_the_leaf_that_differs():
  differs = dict(SAME, **{"['lm_head']": (5.5, 6.0, 7.0, 8.0)})
  with pytest.raises(
      SyncMismatch, match=r"logprob probe at version 7: probe token 1's logprob is -3.0000 on the "
      r"rollout engine and -1.0000 on the trainer \(gap 2 > sync.probe_tolerance=0.02\); leaf "
      r"\['lm_head'\] differs on the rollout side \(sum 5.5, the trainer's 5\), so the transfer"):
    check(7, np.array([-0.5, -3.0]), np.array([-0.5, -1.0]), 0.02, lambda: (SAME, differs))


def test_a_mismatch_with_equal_weights_blames_the_engines_program():
  with pytest.raises(SyncMismatch, match="every leaf's fingerprint agrees, so the engine's program computes"):
    check(3, np.array([-0.5]), np.array([-0.9]), 0.02, lambda: (SAME, dict(SAME)))


def test_at_version_0_the_fix_is_the_dtype_or_the_tolerance_not_a_resume():
  """No step has run, so no checkpoint exists: the message names model.dtype and sync.probe_tolerance."""
  with pytest.raises(SyncMismatch) as e:
    check(0, np.array([-0.5, -1.12]), np.array([-0.5, -1.0]), 0.02, lambda: (SAME, dict(SAME)))
  message = str(e.value)
  assert message.endswith("every leaf's fingerprint agrees, so the engine's program computes differently from the "
                          "trainer's; before this run's first step that is rounding or an engine bug: with "
                          "model.dtype=bfloat16 run --config.model.dtype=float32, or allow the gap with "
                          "--config.sync.probe_tolerance=0.2"), message
  assert "--resume" not in message and "\n" not in message


def test_later_the_fix_is_a_resume_and_a_corrupt_transfer_at_version_0_a_new_start():
  with pytest.raises(
      SyncMismatch, match=r"--resume continues from the last checkpoint "
      r"\(--config.sync.probe_tolerance=0.04 allows the gap\)$"):
    check(12, np.array([-0.534]), np.array([-0.5]), 0.02, lambda: (SAME, dict(SAME)))
  differs = dict(SAME, **{"['embed']": (0.0, 2.0, 3.0, 4.0)})
  with pytest.raises(SyncMismatch, match=r"so the transfer corrupted it; start the run again$"):
    check(0, np.array([-3.0]), np.array([-1.0]), 0.02, lambda: (SAME, differs))
