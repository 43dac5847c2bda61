"""Imports from a source checkout that is not installed (``PYTHONPATH=<checkout>``, a batch job on a
shared file system): the checkout's agent/, trainer/ and tui/ folders are ``trainguard.agent``,
``trainguard.trainer`` and ``trainguard.tui``, as the package map (setup.py) installs them. An
installed trainguard (a wheel, or an editable install's own finder) is found first."""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

FOLDERS = ("agent", "trainer", "tui")
ROOT = Path(__file__).resolve().parent.parent


class CheckoutFolders:
    """A meta path finder for the three folders of the checkout at ``ROOT``, and nothing else."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: ModuleType | None = None) -> ModuleSpec | None:
        package, _, folder = name.partition(".")
        if package != "trainguard" or folder not in FOLDERS:
            return None
        init = ROOT / folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])


def install() -> None:
    """Add the finder when this package runs from a checkout (its setup.py beside it), once."""
    if (ROOT / "setup.py").is_file() and not any(f is CheckoutFolders for f in sys.meta_path):
        sys.meta_path.append(CheckoutFolders)


install()
