"""README.md is the landing page: the two set-up commands on top, at most 200 lines, its
links into the site resolve. (Its Python blocks run in tests/test_docs.py, with the
site's.)"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readme_opens_with_the_two_commands():
    first_block = _readme().split("```")[1]
    assert first_block.split("\n")[1:3] == ["pip install . && multistep blobs",
                                            "pip install -e '.[test]' && python -m pytest"]


def test_readme_is_a_landing_page_of_at_most_200_lines():
    assert len(_readme().splitlines()) <= 200


def test_readme_links_into_the_site_resolve():
    links = re.findall(r"\]\((docs/[^)#]+\.md)(?:#[^)]*)?\)", _readme())
    assert len(links) >= 10
    for link in links:
        assert os.path.isfile(os.path.join(ROOT, link)), link
