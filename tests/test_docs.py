"""The documentation site (docs/, mkdocs.yml) and README.md: their code runs, their
Errors page lists every refusal the library raises, their API reference names every
public name, their Command line page shows every subcommand's help, and the site builds
in strict mode."""

import glob
import html as html_lib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import docs_pages  # noqa: E402  (tests/ is not a package)

ROOT = docs_pages.ROOT

# What a page's blocks must print: a check that they did what the page says they do.
PRINTS = {
    "README.md": ["10\n"],
    "getting-started.md": ["(bitwise equal)"],
    "guides/unroll.md": ["inner step 2 uses 'MatMul' (MatMul)"],
    "guides/tf2-keras.md": ["(10,) [ 1  2  3  4  5  6  7  8  9 10]"],
    # the loop that catches its input's end: 5 steps made as written, 6 runs as written
    # (its source is the page, not Python: the try is found in the bytecode)
    "guides/loop-as-written.md": ["float32\n0 20\n", "\n5\n6\n"],
}


@pytest.mark.parametrize("page", docs_pages.pages())
def test_every_code_block_names_its_language(page):
    found = docs_pages.blocks(docs_pages.read(page))
    for block in found:
        assert block.lang in docs_pages.LANGUAGES, (
            f"{page}:{block.line}: a code block needs one of {docs_pages.LANGUAGES} after its "
            f"```, got {block.lang!r}")
        if block.lang == "python" and block.info:
            assert docs_pages.NOT_RUN.match(block.info), (
                f'{page}:{block.line}: a python block runs, or says title="Not run: why"; '
                f"got {block.info!r}")
    fences = len(re.findall(r"^ *```", docs_pages.read(page), re.M))
    assert fences == 2 * len(found), f"{page}: a fence the block parser did not pair"


@pytest.mark.parametrize("page", [p for p in docs_pages.pages()
                                  if any(b.runs for b in docs_pages.blocks(docs_pages.read(p)))])
def test_python_blocks_run(page, capsys):
    """A page's python blocks run in order in one namespace, as a reader would paste them."""
    namespace = {"__name__": "__docs__"}
    for block in docs_pages.blocks(docs_pages.read(page)):
        if block.runs:
            exec(compile("\n" * (block.line) + block.code, page, "exec"), namespace)
    out = capsys.readouterr().out
    for text in PRINTS.get(page.removeprefix("docs/"), []):
        assert text in out, f"{page} should print {text!r}; printed:\n{out[-2000:]}"


def test_errors_page_lists_every_refusal():
    text = docs_pages.read("docs/errors.md")
    lines = docs_pages.message_lines(text)
    found = docs_pages.refusals()
    assert len(found) > 150  # the walk finds the library's raises (258 when this was written)
    missing = [r for r in found if not docs_pages.documented(r, lines)]
    assert not missing, ("docs/errors.md has no entry whose message line holds these "
                         "refusals' class and the fixed text of their message; add an entry "
                         "(the format: the note at the top of docs/errors.md) in the section "
                         "where a user meets it, e.g.:\n\n"
                         + "\n".join(f"{r!r}\n\n{r.entry()}" for r in missing))


# Messages the package gives at run time other than by a raise or warnings.warn it makes
# (an Assert in the compiled graph, TensorFlow's error rewritten, a logged line), and the
# exceptions of a run that stops midway: (class, a fixed phrase of the message). Each is
# an Errors page entry's message line, and each phrase is text of the package's source.
RUN_TIME_MESSAGES = [
    ("InvalidArgumentError", "and no value was fed to it"),  # an unfed per-step input
    ("InvalidArgumentError", "must hold one batch per step"),
    ("InvalidArgumentError", "leading dimension must equal steps="),
    ("InvalidArgumentError", "must equal the steps this run does"),
    ("InvalidArgumentError", "has a non-finite"),
    ("InvalidArgumentError", "a step had a non-finite value and halted the run"),
    ("StepFailedError", "the run failed at its step"),
    ("InputExhaustedError", "the input ran out during a run"),
    ("OriginalOpRanWarning", "ran beside the compiled program"),
    ("StaleForwardError", "a silently wrong result"),
    ("WorkerLostError", "A synchronous multi-worker step needs every worker"),
    ("", "the step deferred by the run call at"),
    ("", "advanced the global step by fewer than"),
]


def test_errors_page_has_the_run_time_messages():
    lines = docs_pages.message_lines(docs_pages.read("docs/errors.md"))
    source = docs_pages.package_literals()
    for kind, phrase in RUN_TIME_MESSAGES:
        assert any(phrase in literal for literal in source), (
            f"{phrase!r} is no longer text of multistep/: update RUN_TIME_MESSAGES and "
            f"docs/errors.md")
        assert any(kind in line and phrase in line for line in lines), (
            f"docs/errors.md has no entry whose message line holds {kind} and {phrase!r}")


def test_errors_page_entries_have_unique_anchors():
    """Each entry (### heading) and section (##) has an explicit anchor, unique, that a
    link or the search lands on; each entry has its message, what it means, what to do."""
    text = docs_pages.read("docs/errors.md")
    found = docs_pages.entries(text)
    assert len(found) > 150
    anchors = [a for _, a, _ in docs_pages.sections(text)] + [e.anchor for e in found]
    for title, anchor, line in docs_pages.sections(text):
        assert anchor, f"docs/errors.md:{line}: section {title!r} needs {{ #anchor }}"
    for entry in found:
        assert entry.anchor and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", entry.anchor), (
            f"{entry!r}: an entry's heading ends with {{ #anchor }}, lowercase words and "
            f"hyphens")
        assert entry.messages and all(m.startswith("`") for m in entry.messages), (
            f"{entry!r}: the message line (`Class`: `` message ``) follows the heading")
        assert entry.means and entry.do, f"{entry!r}: needs **What it means.** and **What to do.**"
    repeated = sorted({a for a in anchors if anchors.count(a) > 1})
    assert not repeated, f"docs/errors.md: anchors used twice: {repeated}"


def test_the_refusal_walk_finds_a_new_raise_and_its_phrase(tmp_path, monkeypatch):
    """The check above fails for an undocumented raise: a module with one, walked the same way."""
    package = tmp_path / "multistep"
    package.mkdir()
    (package / "new.py").write_text(
        "def f(x):\n"
        "    if x < 0:\n"
        "        raise ValueError(f'x must be >= 0 for the new thing, got {x!r}.')\n"
        "    warnings.warn('the new thing is slow', RuntimeWarning)\n")
    monkeypatch.setattr(docs_pages, "ROOT", str(tmp_path))
    found = docs_pages.refusals()
    assert [(r.kind, r.phrase) for r in found] == [
        ("ValueError", "x must be >= 0 for the new thing, got"), ("RuntimeWarning", "the new thing is slow")]
    page = docs_pages.message_lines("### x must be >= 0 { #x-must-be }\n\n"
                                    "`ValueError`: `` x must be >= 0, got … ``\n\n"
                                    "**What it means.** …\n\n**What to do.** …\n")
    assert page and not any(docs_pages.documented(r, page) for r in found)
    # a message line outside an entry (here: in a comment) documents nothing
    comment = "<!--\n" + "\n".join(r.entry() for r in found) + "-->\n"
    assert not docs_pages.message_lines(comment)
    assert all(docs_pages.documented(r, docs_pages.message_lines(r.entry())) for r in found)


@pytest.mark.parametrize("page", docs_pages.pages())
def test_code_lines_fit_in_88_columns(page):
    """A code block's lines are at most 88 characters: on the site no block scrolls sideways."""
    long = docs_pages.long_code_lines(docs_pages.read(page))
    assert not long, (f"{page}: code lines over {docs_pages.CODE_COLUMNS} characters (line, "
                      f"length): {long}; wrap them (a python block must stay valid Python)")


def test_code_line_check_finds_a_long_line():
    text = "```text\n" + "x" * 88 + "\n" + "y" * 89 + "\n```\n"
    assert docs_pages.long_code_lines(text) == [(3, 89)]


def test_benchmarks_page_links_the_changelog():
    """The history of the figures is the changelog's; the Benchmarks page links it."""
    assert "(changelog.md" in docs_pages.read("docs/benchmarks.md")


def test_front_door_leads_to_the_loop_as_written():
    """The README and the site's home page name `multistep run` and link the guide of the
    loop as written (the user's loop untouched is the first thing either offers)."""
    for page, link in [("README.md", "docs/guides/loop-as-written.md"),
                       ("docs/index.md", "guides/loop-as-written.md")]:
        text = docs_pages.read(page)
        assert "multistep run" in text, f"{page} does not name `multistep run`"
        assert f"]({link})" in text, f"{page} has no link to {link}"


# A tracker reference ("issue 48", "case 23", "round 6") and a parenthesised list of bare
# numbers ("(39)", "(30, 36)"): what CHANGELOG.md says instead is what the user got.
TRACKER = re.compile(r"\b(issue|issues|case|cases|round)\s+\d", re.I)
BARE_NUMBERS = re.compile(r"\(\d+(?:\s*,\s*\d+)*\)")


def test_changelog_cites_no_tracker_numbers():
    """The changelog speaks the users' words, not the tracker's."""
    assert TRACKER.search("Fixed (Issue 49, case 2)") and BARE_NUMBERS.search("(30, 36)")
    assert not BARE_NUMBERS.search("3.9 s (0.1 s), (N = 16)")  # figures are not cited
    for number, line in enumerate(docs_pages.read("CHANGELOG.md").splitlines(), 1):
        assert not TRACKER.search(line), f"CHANGELOG.md:{number}: a tracker reference: {line!r}"
        assert not BARE_NUMBERS.search(line), (
            f"CHANGELOG.md:{number}: a parenthesised bare number: {line!r}")


def _api_directives():
    text = "".join(docs_pages.read(os.path.join("docs", "api", f))
                   for f in sorted(os.listdir(os.path.join(ROOT, "docs", "api"))))
    return set(re.findall(r"^::: (\S+)$", text, re.M))


def test_api_reference_has_every_public_name():
    import multistep

    directives = _api_directives()
    for name in multistep.__all__:
        module = multistep._NAMES[name]
        target = (f"multistep.{module}" if name in multistep._MODULES
                  else f"multistep.{module}.{name}")
        # a module's directive renders the names in its __all__
        whole_module = name not in multistep._MODULES and f"multistep.{module}" in directives and \
            name in importlib.import_module(f"multistep.{module}").__all__
        assert target in directives or whole_module, f"docs/api/ has no '::: {target}' for ms.{name}"


def test_every_public_callable_has_a_docstring():
    """mkdocstrings leaves out an object without a docstring: its API entry would vanish."""
    import multistep

    modules = sorted(multistep._MODULES)
    names = [(f"ms.{n}", getattr(multistep, n)) for n in multistep.__all__]
    names += [(f"ms.{m}.{n}", getattr(getattr(multistep, m), n))
              for m in modules for n in getattr(multistep, m).__all__]
    missing = [name for name, value in names if callable(value) and not (value.__doc__ or "").strip()]
    assert not missing, f"no docstring: {missing}"


def test_cli_page_shows_every_subcommands_help():
    from multistep.tools import cli

    parser = cli._parser()
    commands = next(a.choices for a in parser._actions if a.choices and a.dest == "command")
    markers = set(re.findall(r"^<!-- help: (multistep(?: [a-z]+)*) -->$",
                             docs_pages.read("docs/cli.md"), re.M))
    assert markers == {"multistep"} | {f"multistep {c}" for c in commands}


def test_cli_help_hook_writes_the_real_help():
    spec = importlib.util.spec_from_file_location("cli_help", os.path.join(ROOT, "docs", "hooks", "cli_help.py"))
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown("before\n<!-- help: multistep verify -->\nafter\n")
    assert page.startswith("before\n```text\n$ multistep verify --help\nusage: multistep verify")
    assert "--explain" in page and page.endswith("```\nafter\n")


_GENERATOR = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


@pytest.mark.skipif(any(importlib.util.find_spec(m.split(".")[0]) is None for m in _GENERATOR),
                    reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_site_builds_in_strict_mode(tmp_path):
    """Broken links, missing anchors, API names that do not resolve and docstrings griffe
    cannot parse are warnings, and --strict makes each one fail the build."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    with open(tmp_path / "site" / "api" / "compile" / "index.html", encoding="utf-8") as f:
        html = f.read()
    assert "fetches" in html and "feed_dict" in html  # ms.compile's docstring, rendered
    # Issue 50: no code on the site scrolls sideways, the API pages' docstrings and
    # signatures (wrapped by ruff, the docs extra's) included.
    long = []
    for path in glob.glob(str(tmp_path / "site" / "**" / "*.html"), recursive=True):
        with open(path, encoding="utf-8") as f:
            for pre in re.findall(r"<pre[^>]*>(.*?)</pre>", f.read(), re.S):
                text = html_lib.unescape(re.sub(r"<[^>]+>", "", pre))
                long += [(os.path.relpath(path, tmp_path), line) for line in text.splitlines()
                         if len(line) > docs_pages.CODE_COLUMNS]
    assert not long, long[:5]
    # every Errors entry's anchor is an id on the page (a brace in a title breaks it)
    with open(tmp_path / "site" / "errors" / "index.html", encoding="utf-8") as f:
        ids = set(re.findall(r'id="([^"]+)"', f.read()))
    anchors = re.findall(r"\{ #([\w-]+) \}$", docs_pages.read("docs/errors.md"), re.M)
    assert len(anchors) > 100 and not [a for a in anchors if a not in ids]
    # Issue 50: the version on every page, from its one source, and the changelog there,
    # its newest release the version.
    import multistep

    with open(tmp_path / "site" / "changelog" / "index.html", encoding="utf-8") as f:
        changelog = f.read()
    assert f"multistep {multistep.__version__}" in changelog
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        releases = re.findall(r"^## \[([\d.]+)\] - \d{4}-\d\d-\d\d$", f.read(), re.M)
    assert releases[0] == multistep.__version__, releases
    assert "Keep a Changelog" in changelog and f"{releases[-1]}" in changelog


def _bench_rows(block):
    """A ``multistep bench`` table's rows as {(N, method): the row's figures}, whichever
    columns a page kept (a row's figures are its numbers, ratios and spreads in order)."""
    rows = {}
    for line in block.splitlines():
        found = re.match(r"^\s*(?:blobs\s+)?(\d+)\s{2}(\S.*?)\s{2,}(\d.*)$", line)
        if found:
            key = (int(found.group(1)), found.group(2), "x" in found.group(3))
            rows[key] = found.group(3).split()
    return rows


def test_choosing_guide_quotes_the_figures_of_the_run_it_shows():
    """Issue 50: the speed figures in the Choosing guide's text are those of the table it
    shows, and that table is the Benchmarks page's run (the same rows, the same figures)."""
    guide = docs_pages.read("docs/guides/choosing.md")
    section = guide[guide.index("## How much faster"):guide.index("What the measurements say")]
    shown = next(b.code for b in docs_pages.blocks(section) if b.lang == "text")
    run = next(b.code for b in docs_pages.blocks(docs_pages.read("docs/benchmarks.md"))
               if b.lang == "text" and "multistep bench: blobs" in b.code)
    shown_rows, run_rows = _bench_rows(shown), _bench_rows(run)
    assert len(shown_rows) >= 18, shown_rows
    for key, figures in shown_rows.items():
        assert run_rows.get(key, [])[-len(figures):] == figures, (key, figures, run_rows.get(key))
    prose = section[section.index("<!-- The figures quoted"):]
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)
    quoted = re.findall(r"(\d+\.\d+)×", prose)
    assert len(quoted) >= 8, quoted
    table = {f for figures in shown_rows.values() for f in figures}
    assert not [q for q in quoted if q + "x" not in table], quoted
