"""pytest setup: import kuai from the build tree (build/python) unless PYTHONPATH already has it,
and find the kuai CLI (KUAI_BIN, else build/kuai) for the tests that compare against it."""

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("KUAI_BUILD_DIR", ROOT / "build"))
# (From the repository root, the C++ sources' kuai/ folder would import as an empty namespace
# package: the build tree's package goes first unless PYTHONPATH already names one.)
if not any(pathlib.Path(p, "kuai", "__init__.py").exists() for p in sys.path if p):
    sys.path.insert(0, str(BUILD / "python"))


@pytest.fixture(scope="session")
def kuai_bin():
    path = pathlib.Path(os.environ.get("KUAI_BIN", BUILD / "kuai"))
    if not path.exists():
        pytest.fail(f"the kuai CLI is not built at {path} (set KUAI_BIN)")
    return str(path)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small byte-level token file: some text, repeated (the CLI and Python read the same)."""
    import kuai

    text = (
        "In the beginning God created the heaven and the earth. And the earth was without "
        "form, and void; and darkness was upon the face of the deep. "
    ) * 40
    path = tmp_path_factory.mktemp("corpus") / "tokens.bin"
    kuai.data.write_token_file(str(path), list(text.encode()), 1)
    return str(path)
