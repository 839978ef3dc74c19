"""Sphinx configuration: MyST pages, the API reference from the docstrings."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jmp_lab"
author = "jmp_lab developers"
copyright = "2026, jmp_lab developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",   # the API page's one-line-per-name tables
    "sphinx.ext.napoleon",      # the docstrings' Args:/Returns: sections
    "sphinx.ext.viewcode",
]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]

autosummary_generate = False   # tables only: the entries are documented below them
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False,
                           "no-value": True}  # data is described, not dumped
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True    # a dataclass's Attributes: fields, not objects twice

html_theme = "sphinx_book_theme"
html_title = "jmp_lab"
html_static_path = ["_static"]
html_theme_options = {"show_toc_level": 2}
