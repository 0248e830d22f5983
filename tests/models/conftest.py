import numpy as np
import pytest
from hf_support import SHAPE, save_tiny, torch_greedy, torch_logits


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
  """family -> (model dir, torch model, prompt ids [2, 12], logits, 32 greedy tokens), made once."""
  made = {}

  def get(family):
    if family not in made:
      path = str(tmp_path_factory.mktemp(family))
      model = save_tiny(family, path)
      ids = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], (2, 12))
      made[family] = (path, model, ids, torch_logits(model, ids), torch_greedy(model, ids, 32))
    return made[family]

  return get
