"""The image's build context: every file docker/Dockerfile copies is sent to the daemon.

`.dockerignore` starts from "send nothing" and names what the image needs; a file the Dockerfile
copies but the list leaves out fails `docker build` at that step ("file not found in build
context"), which CI, without a Docker engine, would otherwise never see. The rules are read as
Docker reads them: each line a pattern relative to the context root, `!` an exception, the last
line that matches a path decides, and a pattern that matches a folder matches what is under it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rules() -> list[tuple[bool, str]]:
    """(excluded, pattern) for each line of .dockerignore, in order."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        included = line.startswith("!")
        rules.append((not included, line.lstrip("!").strip("/")))
    return rules


def _regex(pattern: str) -> re.Pattern:
    """Docker's pattern syntax: ``*`` and ``?`` stay within a folder, ``**/`` spans any number of them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _matches(pattern: str, path: str) -> bool:
    """The pattern against the path or any folder above it (excluding a folder excludes its files)."""
    parts = path.split("/")
    return any(_regex(pattern).fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1))


def sent(path: str) -> bool:
    """Whether ``docker build .`` sends ``path`` (relative to the checkout) to the daemon."""
    excluded = False
    for is_exclusion, pattern in _rules():
        if _matches(pattern, path):
            excluded = is_exclusion
    return not excluded


def copied_sources() -> list[str]:
    """The context paths of the Dockerfile's COPY and ADD lines (not those copied from another stage)."""
    sources = []
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        if line.split()[:1] not in (["COPY"], ["ADD"]):
            continue
        words = shlex.split(line, comments=True)
        arguments = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        sources.extend(arguments[:-1])
    return sources


def test_the_rules_read_as_docker_reads_them():
    assert sent("setup.cfg") and sent("smddp_lite/__init__.py") and sent("docker/entrypoint.py")
    assert not sent(".venv/bin/python") and not sent("tests/test_docs.py") and not sent("docker/Dockerfile")
    assert not sent("smddp_lite/__pycache__/x.pyc") and not sent("__pycache__/y.pyc")


def test_every_file_the_dockerfile_copies_is_in_the_build_context():
    sources = copied_sources()
    assert "docker/entrypoint.py" in sources, f"the Dockerfile's COPY lines were not found: {sources}"
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"docker/Dockerfile copies {source}, which the checkout does not have"
        files = [path] if path.is_file() else [p for p in path.rglob("*")
                                                if p.is_file() and "__pycache__" not in p.parts]
        assert files, f"docker/Dockerfile copies {source}, an empty folder"
        left_out = [str(f.relative_to(ROOT)) for f in files if not sent(str(f.relative_to(ROOT)))]
        assert not left_out, (f"docker/Dockerfile copies {source}, but .dockerignore leaves out {left_out[:5]}: "
                              f"`docker build` would fail there; add a line `!{source}` to .dockerignore")
