"""The one way benchmarks rewrite their table in benchmarks/README.md: the text between a
script's `<!-- NAME:begin -->` and `<!-- NAME:end -->` markers, so the prose around it stays."""
import json
import os
import re

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")


def write_section(name: str, text: str, heading: str):
  """Replaces NAME's block with text; without the markers, appends `## heading` and the block."""
  begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
  body = open(README).read() if os.path.exists(README) else "# Benchmarks\n"
  section = f"{begin}\n{text}\n{end}"
  if begin in body:
    body = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, body, flags=re.S)
  else:
    body = body.rstrip() + f"\n\n## {heading}\n\n" + section + "\n"
  with open(README, "w") as f:
    f.write(body)


def report(path: str, data, text: str, readme: bool, name: str, heading: str):
  """A benchmark run's end: data as JSON at path, text printed and, with readme, NAME's section."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f, indent=2)
  print(text)
  if readme:
    write_section(name, text, heading)
