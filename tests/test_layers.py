"""The package's imports follow the layer table in docs/concepts.md: no module imports one above
its own layer, nothing imports in a circle, and imports of jaxrl_hex modules sit at module level."""
import ast
import gc
import os
import re

from support import ROOT

PACKAGE = os.path.join(ROOT, "jaxrl_hex")
LAZY_OK = {"ray", "torch", "transformers", "wandb", "matplotlib", "openai"}  # optional or heavy third-party packages


def _layers() -> dict:
  """docs/concepts.md's layer table -> {module or package name: layer}."""
  text = open(os.path.join(ROOT, "docs", "concepts.md")).read()
  table = text.split("<!-- layers:begin -->")[1].split("<!-- layers:end -->")[0]
  layers = {}
  for row in table.strip().splitlines()[2:]:
    cells = [c.strip() for c in row.strip("|").split("|")]
    for name in re.findall(r"`([\w.]+)`", cells[1]):
      layers[name] = int(cells[0])
  return layers


def _modules() -> dict:
  """{dotted module name: source path} for every module of the package."""
  out = {}
  for dirpath, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
        out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


def _parse(path):
  # CPython 3.11 keeps one AST-building depth counter per interpreter. A finalizer the collector
  # runs mid-parse can parse too (asyncio logging an orphaned orbax task formats a traceback, and
  # 3.11's traceback parses the line) and leaves the counter off: SystemError "AST constructor
  # recursion depth mismatch" (cpython gh-106905). With the collector off no finalizer runs.
  was_on = gc.isenabled()
  gc.disable()
  try:
    return ast.parse(open(path).read())
  finally:
    if was_on:
      gc.enable()


def _imports(path, modules):
  """-> [(imported jaxrl_hex module, line, inside a function)], plus [(third-party top name, line)]
  of imports made inside functions."""
  tree = _parse(path)
  internal, lazy = [], []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      names = []
      if isinstance(child, ast.Import):
        names = [a.name for a in child.names]
      elif isinstance(child, ast.ImportFrom) and child.module:
        names = [
            f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in modules else child.module for a in child.names
        ]
      for name in names:
        if name.split(".")[0] == "jaxrl_hex":
          internal.append((name, child.lineno, in_function))
        elif in_function:
          lazy.append((name.split(".")[0], child.lineno))
      visit(child, inner)

  visit(tree, False)
  return internal, lazy


def _layer_of(module, layers):
  name = module.removeprefix("jaxrl_hex.")
  while name not in layers:
    assert "." in name, f"{module} has no layer in docs/concepts.md; add it to the table"
    name = name.rsplit(".", 1)[0]
  return layers[name]


def test_layer_table_names_every_module():
  layers = _layers()
  assert layers["errors"] == 0 and layers["cli"] == max(layers.values())
  for module in _modules():
    if module != "jaxrl_hex":
      _layer_of(module, layers)


def test_no_module_imports_a_layer_above_its_own():
  layers, modules = _layers(), _modules()
  upward = []
  for module, path in modules.items():
    if module == "jaxrl_hex":
      continue
    own = _layer_of(module, layers)
    for imported, line, _ in _imports(path, modules)[0]:
      if imported != "jaxrl_hex" and _layer_of(imported, layers) > own:
        upward.append(f"{module} (layer {own}) imports {imported} (layer {_layer_of(imported, layers)}) at line {line}")
  assert not upward, "\n".join(upward)


def test_no_import_cycle():
  modules = _modules()
  graph = {m: sorted({i for i, _, _ in _imports(p, modules)[0] if i in modules and i != m}) for m, p in modules.items()}
  state, stack, cycles = {}, [], []

  def walk(m):
    state[m] = "open"
    stack.append(m)
    for n in graph[m]:
      if state.get(n) == "open":
        cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
      elif n not in state:
        walk(n)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      walk(m)
  assert not cycles, "\n".join(cycles)


def test_internal_imports_sit_at_module_level_and_packages_lower_layers_import_through_are_empty():
  modules = _modules()
  hidden = []
  for module, path in modules.items():
    internal, lazy = _imports(path, modules)
    hidden += [f"{module}:{line} imports {name} inside a function" for name, line, inside in internal if inside]
    hidden += [f"{module}:{line} imports {name} inside a function" for name, line in lazy if name not in LAZY_OK]
  assert not hidden, "\n".join(hidden)
  for package in ("jaxrl_hex", "jaxrl_hex.models"):
    internal, _ = _imports(modules[package], modules)
    assert not internal, f"{package}/__init__.py imports {internal}; lower layers import through it"
