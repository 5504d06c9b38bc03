"""Griffe extension: a Google-style ``Example:`` section is read as ``Examples:``, as
Sphinx's napoleon reads it, so its ``>>>`` lines render as code on the API pages (griffe
would otherwise take ``Example:`` for an admonition and its ``>>>`` for quotes)."""

import re

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\g<indent>Examples:", obj.docstring.value)
