"""Character tokenizer for built-in tasks: ids 0..2 are pad, bos, eos; one id per character."""
from jaxrl_hex.errors import UserError

PAD, BOS, EOS = 0, 1, 2


class CharTokenizer:
  pad_id, bos_id, eos_id = PAD, BOS, EOS

  def __init__(self, alphabet: str):
    chars = sorted(set(alphabet))
    self.chars = "".join(chars)
    self._ids = {c: i + 3 for i, c in enumerate(chars)}

  @property
  def vocab_size(self) -> int:
    return len(self._ids) + 3

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[c] for c in text]
    except KeyError as e:
      raise UserError(f"tokenizer: character {e.args[0]!r} is not in the task's alphabet {self.chars!r}") from None

  def decode(self, ids) -> str:
    out = []
    for i in ids:
      i = int(i)
      if i == EOS:
        break
      if i >= 3:  # ids past the alphabet (a model's padded vocab) read as U+FFFD, never as a digit
        out.append(self.chars[i - 3] if i - 3 < len(self.chars) else "\ufffd")
    return "".join(out)
