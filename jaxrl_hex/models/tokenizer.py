"""Tokenizers: characters for built-in tasks (ids 0..2 are pad, bos, eos; one id per character),
and Hugging Face tokenizer directories for real models."""
import datetime
import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxrl_hex.errors import UserError

PAD, BOS, EOS = 0, 1, 2


class CharTokenizer:
  pad_id, bos_id, eos_id = PAD, BOS, EOS
  # How ids 0..2 are spelled in an exported tokenizer.json: no text a task's alphabet spells out
  SPECIAL = ("<|pad|>", "<|bos|>", "<|eos|>")

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

  def save_pretrained(self, out_dir: str):
    """tokenizer.json + tokenizer_config.json that transformers.AutoTokenizer (and HFTokenizer) load
    as this tokenizer: the same id for every character, and BOS put before each text, as the engine
    puts it, so tokenizer(prompt) gives the ids the run's engine generated from."""
    vocab = {t: i for i, t in enumerate(self.SPECIAL)} | {c: i + 3 for i, c in enumerate(self.chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # one piece per character
    tok.decoder = decoders.Fuse()  # joined with no separator
    tok.post_processor = processors.TemplateProcessing(single=f"{self.SPECIAL[BOS]} $A",
                                                       special_tokens=[(self.SPECIAL[BOS], BOS)])
    tok.add_special_tokens(list(self.SPECIAL))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": self.SPECIAL[PAD],
        "bos_token": self.SPECIAL[BOS],
        "eos_token": self.SPECIAL[EOS],
        "clean_up_tokenization_spaces": False
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=2)


class HFTokenizer:
  """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) behind the
  interface the engine and trainer use: encode, decode, bos_id, eos_id, pad_id, vocab_size.

  encode adds no special tokens: the engine puts bos_id before every prompt. A tokenizer with no
  BOS (Qwen) gets its pad token there, the document separator it was pretrained with. eos_id is
  the token that ends a completion: tokenizer_config.json's eos_token unless `eos_token` is given
  (a chat model's end of turn, e.g. "<|im_end|>").
  """

  def __init__(self, path: str, eos_token: str | None = None):
    self.dir = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(self.dir, "tokenizer.json")
    if not os.path.isfile(file):
      raise UserError(f"tokenizer: {self.dir} has no tokenizer.json (a Hugging Face `tokenizers` file); "
                      "point model_dir at a directory that has one")
    self._tok = Tokenizer.from_file(file)
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
      if os.path.isfile(os.path.join(self.dir, name)):
        with open(os.path.join(self.dir, name)) as f:
          config.update(json.load(f))
    self.special = {
        k: (v["content"] if isinstance(v, dict) else v) for k, v in config.items()
        if k.endswith("_token") and v is not None
    }
    eos = eos_token or self.special.get("eos_token")
    if eos is None:
      raise UserError(f"tokenizer: {self.dir}/tokenizer_config.json names no eos_token; pass the token that "
                      "ends a completion (task_args.eos_token)")
    self.eos_id = self._id(eos)
    self.pad_id = self._id(self.special["pad_token"]) if "pad_token" in self.special else self.eos_id
    self.bos_id = self._id(self.special["bos_token"]) if "bos_token" in self.special else self.pad_id
    self.chat_template = _chat_template(config.get("chat_template"), os.path.join(self.dir, "chat_template.jinja"))

  def _id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise UserError(f"tokenizer: special token {token!r} is not in {self.dir}/tokenizer.json")
    return i

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def adds_bos(self) -> bool:
    """Whether tokenizer.json itself puts bos_id before a text, as transformers' tokenizer(text) then
    does: the engine's prompts and a transformers user's are then the same ids."""
    # an empty text: any vocabulary encodes it (a character vocabulary may lack every letter)
    return self._tok.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._tok.decode(ids, skip_special_tokens=True)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
    """The chat template rendered as transformers renders it (same jinja settings and globals);
    tools: function schemas (jaxrl_hex.tasks.tools.Tool.schema) for templates that list them."""
    if self.chat_template is None:
      raise UserError(f"tokenizer: {self.dir} has no chat template (tokenizer_config.json chat_template "
                      "or chat_template.jinja)")
    extra = {"tools": list(tools)} if tools else {}
    return self.chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special,
                                     **extra)

  def prompt(self, text: str, system: str | None = None) -> str:
    """A task prompt as the model expects it: a user turn of the chat template when there is one,
    minus a leading BOS (the engine adds bos_id); the text itself otherwise."""
    if self.chat_template is None:
      return text
    return self.prompt_messages(([{
        "role": "system",
        "content": system
    }] if system else []) + [{
        "role": "user",
        "content": text
    }])

  def prompt_messages(self, messages: list[dict], tools=None) -> str:
    """Chat messages opened for the model's reply (the generation prompt), minus a leading BOS."""
    out = self.apply_chat_template(messages, tools=tools)
    bos = self.special.get("bos_token")
    return out[len(bos):] if bos and out.startswith(bos) else out

  def token_text(self, token_id: int) -> str:
    """A token's text as the template writes it (special tokens included)."""
    return self._tok.id_to_token(int(token_id)) or ""


def _chat_template(template, jinja_file):
  """The compiled default chat template, or None. Sandboxed: templates come with downloaded models."""
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
    template = {t["name"]: t["template"] for t in template}.get("default")
  if template is None and os.path.isfile(jinja_file):
    with open(jinja_file) as f:
      template = f.read()
  if template is None:
    return None

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(template)
