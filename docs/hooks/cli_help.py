"""MkDocs hook: a line ``<!-- help: multistep SUBCOMMAND -->`` becomes that command's real
``--help`` output, run at build time, so the Command line page cannot drift from the code.

The command runs as ``python -m multistep ... --help`` with the Python that builds the
site (``--help`` does not import TensorFlow) and a fixed width of 88 columns.
"""

import os
import re
import subprocess
import sys

MARKER = re.compile(r"^<!-- help: multistep(?P<args>(?: [a-z]+)*) -->$", re.M)


def help_text(args):
    """The ``--help`` output of ``multistep ARGS``, as a user's terminal 88 columns wide shows it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, COLUMNS="88", PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-m", "multistep", *args, "--help"], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout


def on_page_markdown(markdown, **kwargs):
    def block(match):
        args = match.group("args").split()
        return f"```text\n$ multistep {' '.join(args + ['--help'])}\n{help_text(args)}```"
    return MARKER.sub(block, markdown)
