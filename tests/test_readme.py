"""The README's Python blocks run, in order, in one namespace, as a reader would paste them."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_opens_with_the_two_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        first_block = f.read().split("```")[1]
    assert first_block.split("\n")[1:3] == ["pip install . && multistep blobs",
                                            "pip install -e '.[test]' && python -m pytest"]


def test_readme_python_blocks_run(capsys):
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 4
    namespace = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "inner step 2 uses 'MatMul' (MatMul)" in out
    assert "(bitwise equal)" in out
    assert namespace["report"].ok


def test_every_error_in_the_table_names_an_existing_test():
    with open(os.path.join(ROOT, "README.md")) as f:
        table = f.read().split("## Errors", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"`(tests/test_\w+\.py)::(\w+)`", table)
    assert len(rows) >= 40
    for path, name in rows:
        with open(os.path.join(ROOT, path)) as f:
            assert re.search(rf"^def {name}\(", f.read(), re.M), f"{path}::{name}"
