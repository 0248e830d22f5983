"""HFTokenizer against transformers' own tokenizer on the same files."""
import pytest
from hf_support import save_tokenizer

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.tokenizer import HFTokenizer

TEXTS = [
    "Natalia sold clips to 48 of her friends in April.", "How many clips did she sell altogether?",
    "The answer is \\boxed{72}.", "Weng earns $12 an hour for babysitting."
] * 20
MESSAGES = [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(params=[False, True], ids=["no_bos", "bos"])
def tokenizer_dir(request, tmp_path):
  save_tokenizer(str(tmp_path), TEXTS, bos=request.param)
  return str(tmp_path)


def test_encode_decode_and_chat_template_match_transformers(tokenizer_dir):
  import transformers
  theirs = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  ours = HFTokenizer(tokenizer_dir)
  text = "Weng earns $12 an hour; she sold 48 clips. <|im_end|> after"
  assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
  assert ours.vocab_size == len(theirs)
  assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(MESSAGES, tokenize=False,
                                                                          add_generation_prompt=True)
  assert (ours.eos_id, ours.pad_id) == (theirs.eos_token_id, theirs.pad_token_id)
  ids = ours.encode("She sold 48 clips.")
  assert ours.decode(ids + [ours.eos_id] + ours.encode(" ignored")) == "She sold 48 clips."


def test_prompt_leaves_the_bos_to_the_engine(tokenizer_dir):
  ours = HFTokenizer(tokenizer_dir)
  prompt = ours.prompt("What is 2 + 3?")
  if ours.special.get("bos_token"):  # the template wrote <s>; the engine prepends bos_id instead
    assert ours.bos_id == ours.encode("<s>")[0] and not prompt.startswith("<s>")
    assert prompt == "<turn>user: What is 2 + 3?<|im_end|><turn>assistant: "
  else:  # no BOS in the vocabulary: prompts start with the pad token (Qwen's document separator)
    assert ours.bos_id == ours.pad_id == ours.encode("<|endoftext|>")[0]
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
  with pytest.raises(UserError, match="has no tokenizer.json"):
    HFTokenizer(str(tmp_path))
