"""The documentation's pages and code blocks, and the refusals the library raises: what
tests/test_docs.py checks against each other.

Code blocks: every fenced block names its language. ``python`` blocks run, in order,
one namespace a page; a Python block that must not run says so where a reader sees it,
as a title: ```` ```python title="Not run: why" ````. ``bash`` and ``text`` blocks
(commands, output) never run.

Refusals: every ``raise SomeError(...)`` and ``warnings.warn(...)`` in ``multistep/**/*.py``
is known by its class and its message's *fixed phrase*: the longest piece of literal
text in the message (the f-string's text between the values it formats), whitespace
collapsed. The Errors page has an entry for it: a heading ``### title { #anchor }``,
then a message line holding both, then "What it means" and "What to do" (``entries``).

Code lines: a line of a fenced block is at most ``CODE_COLUMNS`` characters, so that no
block scrolls sideways on the site.
"""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
LANGUAGES = ("python", "bash", "text")
NOT_RUN = re.compile(r'^title="Not run: (?P<why>[^"]+)"$')
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
# A fixed phrase shorter than this says too little to find on a page ("expected"); the
# phrase is then taken from the helper that builds the message, or the enclosing function.
MIN_PHRASE = 12
# Raises that are not refusals a user can meet: an abstract method, an internal invariant.
# (A private class, ``_Skipped``, is a module's own control flow, caught where it is raised.)
NOT_REFUSALS = ("NotImplementedError", "AssertionError")
CODE_COLUMNS = 88


def pages():
    """README.md and every page under docs/, as paths relative to the repository."""
    found = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(DOCS, "**", "*.md"),
                                                              recursive=True))
    return ["README.md"] + found


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


class Block:
    def __init__(self, match, text):
        self.lang = match.group("lang")
        self.info = match.group("info").strip()
        indent = len(match.group("indent"))
        self.code = "".join(line[indent:] for line in match.group("body").splitlines(True))
        self.line = text.count("\n", 0, match.start()) + 1

    @property
    def runs(self):
        return self.lang == "python" and not NOT_RUN.match(self.info)


def blocks(text):
    """The fenced code blocks of a Markdown text, in order."""
    return [Block(m, text) for m in FENCE.finditer(text)]


class Refusal:
    """One ``raise`` or ``warnings.warn`` in the library."""

    def __init__(self, path, line, kind, phrase, template):
        self.path, self.line, self.kind, self.phrase, self.template = path, line, kind, phrase, template

    def entry(self):
        """An Errors page entry that documents it (its title, anchor and two paragraphs
        to be written)."""
        kind = self.kind or "TensorFlow's own error, its message rewritten"
        words = re.findall(r"[\w.=']+", self.phrase or self.template)[:8]
        title = " ".join(words) or kind
        anchor = "-".join(re.findall(r"[a-z0-9]+", title.lower())[:6])
        return (f"### {title} {{ #{anchor} }}\n\n`{kind}`: `` {self.template} ``\n\n"
                f"**What it means.** …\n\n**What to do.** …\n")

    def __repr__(self):
        return f"{self.path}:{self.line}: {self.kind}: {self.phrase!r}"


def _normal(text):
    return " ".join(text.split())


def _literals(node, skip_docstring=False):
    body = node.body if skip_docstring and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    doc = body[0].value if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else None
    return [_normal(n.value) for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n is not doc]


def _template(node):
    """The message as a reader sees it, every formatted value shown as "…"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_template(v) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _template(node.left) + _template(node.right)
    return "…"


def _kind(call):
    """The class a raise raises or a warning warns, or None where the code does not name it."""
    if _is_warn(call):
        category = call.args[1] if len(call.args) > 1 else next(
            (k.value for k in call.keywords if k.arg == "category"), None)
        return "UserWarning" if category is None else ast.unparse(category).split(".")[-1]
    name = ast.unparse(call.func).split(".")[-1]
    return name if name[:1].isupper() else None


def _is_warn(call):
    return ast.unparse(call.func) in ("warnings.warn", "warn")


def refusals():
    """Every raise and warning in multistep/**/*.py, each with its fixed phrase."""
    found = []
    paths = sorted(glob.glob(os.path.join(ROOT, "multistep", "**", "*.py"), recursive=True))
    trees = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            trees[path] = ast.parse(f.read())
    # A message may be built by a function of another module (imported): the module's own
    # functions first, then the package's.
    package = {n.name: n for tree in trees.values() for n in ast.walk(tree)
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for path in paths:
        tree = trees[path]
        functions = {**package, **{n.name: n for n in ast.walk(tree)
                                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}}
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                call = node.exc
            elif isinstance(node, ast.Call) and _is_warn(node):
                call = node
            else:
                continue
            kind = _kind(call)
            if kind in NOT_REFUSALS or ast.unparse(call.func).startswith("_") and kind is None and \
                    ast.unparse(call.func)[1:2].isupper():
                continue
            enclosing = _enclosing(node, parents)
            # The message: the first argument that is not an attribute or None (TensorFlow's
            # errors, ``type(error)(error.node_def, error.op, message)`` or ``(None, None,
            # message)``, take it third).
            message = next((a for a in call.args if not isinstance(a, ast.Attribute)
                            and not (isinstance(a, ast.Constant) and a.value is None)), None)
            if isinstance(message, ast.Name) and enclosing is not None:  # message = ...; raise X(message)
                message = next((n.value for n in ast.walk(enclosing) if isinstance(n, ast.Assign)
                                and ast.unparse(n.targets[0]) == message.id), message)
            if isinstance(message, ast.Call) and ast.unparse(message.func) == "str":
                # str(finding): the message is another object's (a check's finding)
                found.append(Refusal(os.path.relpath(path, ROOT), node.lineno, kind or "", "",
                                     f"the message of {ast.unparse(message.args[0])}"))
                continue
            template = _normal(_template(message)) if message is not None else "…"
            phrases = _literals(message) if message is not None else []
            if max(map(len, phrases), default=0) < MIN_PHRASE and len(template.replace("…", "")) >= MIN_PHRASE:
                phrases = [template]
            if max(map(len, phrases), default=0) < MIN_PHRASE:
                helper = _helper(call if message is None else message, functions) or _helper(call, functions)
                if helper is not None:
                    phrases = _literals(helper, skip_docstring=True)
                    kind = kind or _returned_kind(helper)
                elif enclosing is not None:
                    phrases = _literals(enclosing, skip_docstring=True)
            phrase = max(phrases, key=len, default="")
            if phrase not in template:
                template = phrase if template == "…" else f"{template} ({phrase})"
            found.append(Refusal(os.path.relpath(path, ROOT), node.lineno, kind or "", phrase, template))
    return found


def _helper(node, functions):
    """The module's own function that builds the message, if one does."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            name = ast.unparse(call.func).split(".")[-1]
            if name in functions:
                return functions[name]
    return None


def _returned_kind(function):
    """The class of the exception a helper such as ``_lost`` builds and returns."""
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
            return _kind(node.value)
    return None


def _enclosing(node, parents):
    while node in parents and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        node = parents[node]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def documented(refusal, page_lines):
    """Whether a line of the page holds the refusal's class and its fixed phrase."""
    return any(refusal.kind in line and refusal.phrase in line for line in page_lines)


def page_lines(text):
    """The page's lines, whitespace collapsed and Markdown's escaped pipes unescaped."""
    return [_normal(line.replace("\\|", "|")) for line in text.splitlines()]


# The Errors page: an entry is a heading ``### title { #anchor }`` (attr_list's explicit
# id), its message lines (the class and the message, each on one line), then the
# paragraphs "**What it means.** ..." and "**What to do.** ...". HTML comments (the
# maintainers' note) are not part of the page.
HEADING = re.compile(r"^(?P<level>#{1,6}) (?P<title>.*?)(?: \{ *#(?P<anchor>[^\s}]+) *\})?[ \t]*$")
MEANS, DO = "**What it means.**", "**What to do.**"


class Entry:
    """One entry of the Errors page."""

    def __init__(self, title, anchor, line, messages, means, do):
        self.title, self.anchor, self.line = title, anchor, line
        self.messages, self.means, self.do = messages, means, do

    def __repr__(self):
        return f"docs/errors.md:{self.line}: {self.title!r} {{ #{self.anchor} }}"


def _uncommented(text):
    """``text`` without its HTML comments, their lines kept blank (line numbers hold)."""
    return re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def sections(text):
    """The page's ``##`` headings: (title, anchor or None, line)."""
    found = []
    for number, line in enumerate(_uncommented(text).splitlines(), 1):
        m = HEADING.match(line)
        if m and len(m.group("level")) == 2:
            found.append((m.group("title"), m.group("anchor"), number))
    return found


def entries(text):
    """The Errors page's entries (its ``###`` headings and what follows each), in order."""
    found, current = [], None
    for number, line in enumerate(_uncommented(text).splitlines(), 1):
        m = HEADING.match(line)
        if m:
            current = None
            if len(m.group("level")) == 3:
                current = {"title": m.group("title"), "anchor": m.group("anchor"),
                           "line": number, "paragraphs": [[]]}
                found.append(current)
            continue
        if current is None:
            continue
        if line.strip():
            current["paragraphs"][-1].append(line.strip())
        elif current["paragraphs"][-1]:
            current["paragraphs"].append([])
    out = []
    for e in found:
        paragraphs = [" ".join(p) for p in e["paragraphs"] if p]
        means = next((p for p in paragraphs if p.startswith(MEANS)), None)
        do = next((p for p in paragraphs if p.startswith(DO)), None)
        first = next((i for i, p in enumerate(paragraphs) if p.startswith((MEANS, DO))),
                     len(paragraphs))
        out.append(Entry(e["title"], e["anchor"], e["line"], paragraphs[:first], means, do))
    return out


def message_lines(text):
    """The message lines of the Errors page's entries (what ``documented`` searches),
    whitespace collapsed."""
    return page_lines("\n".join(m for e in entries(text) for m in e.messages))


def package_literals():
    """Every string literal of ``multistep/**/*.py``, whitespace collapsed (an f-string's
    text between the values it formats, its implicitly joined pieces one literal)."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "multistep", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            found += _literals(ast.parse(f.read()))
    return found


def long_code_lines(text, columns=CODE_COLUMNS):
    """(line number, length) of each line of a fenced block longer than ``columns``."""
    out = []
    for block in blocks(text):
        for i, line in enumerate(block.code.splitlines(), block.line + 1):
            if len(line) > columns:
                out.append((i, len(line)))
    return out
