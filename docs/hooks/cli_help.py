"""MkDocs hook: a line ``<!-- help: multistep SUBCOMMAND -->`` becomes that command's real
``--help`` output, run at build time, so the Command line page cannot drift from the code.
The site's name carries the package's version (``multistep.__version__``, its one
source), and the Changelog page is ``CHANGELOG.md`` from the repository's top level.

The command runs as ``python -m multistep ... --help`` with the Python that builds the
site (``--help`` does not import TensorFlow) and a fixed width of 88 columns.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = re.compile(r"^<!-- help: multistep(?P<args>(?: [a-z]+)*) -->$", re.M)


def help_text(args):
    """The ``--help`` output of ``multistep ARGS``, as a user's terminal 88 columns wide shows it."""
    env = dict(os.environ, COLUMNS="88", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-m", "multistep", *args, "--help"], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout


def on_page_markdown(markdown, **kwargs):
    def block(match):
        args = match.group("args").split()
        return f"```text\n$ multistep {' '.join(args + ['--help'])}\n{help_text(args)}```"
    return MARKER.sub(block, markdown)


def version():
    """``multistep.__version__``, read from the source (the docs build imports no TensorFlow)."""
    with open(os.path.join(ROOT, "multistep", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)


def on_config(config, **kwargs):
    config.site_name = f"multistep {version()}"
    return config


def on_page_read_source(page, config, **kwargs):
    if page.file.src_uri == "changelog.md":
        with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
            return f.read()
    return None
