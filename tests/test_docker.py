"""The container images (Dockerfile, Dockerfile.cpu) install legato with the README's own commands, serve with
`legato serve` and probe /health; and the README keeps its two set-up commands at the top. The images are
checked as text: building them needs a Docker daemon and the network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
IMAGES = {"Dockerfile": "nvidia/cuda:", "Dockerfile.cpu": "python:3"}


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / name).read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pip_commands(text: str) -> list[str]:
    """Every `pip install ...` command of `text`, cut at `&&`, a backtick, a comment or the line's end."""
    return [m.strip() for m in re.findall(r"pip install [^`&#\n;]+", text)]


def readme_setup() -> list[str]:
    """The commands of the README's first code block (its set-up)."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_readme_keeps_two_set_up_commands_at_the_top():
    assert readme_setup() == ["pip install torch==2.13.0 -e . && legato serve", "bash scripts/test.sh"]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_each_image_installs_with_the_readme_commands(name):
    runs = [args for word, args in instructions(name) if word == "RUN"]
    torch_installs = [c for run in runs for c in pip_commands(run) if "torch" in c]
    readme = set(pip_commands(README))
    assert torch_installs and all(c in readme for c in torch_installs), (torch_installs, readme)
    assert torch_installs[-1] == "pip install torch==2.13.0 -e ."  # the README's set-up command, verbatim
    if name == "Dockerfile.cpu":  # PyTorch's CPU build first, as the README says for a CPU-only machine
        assert torch_installs == ["pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                                  "pip install torch==2.13.0 -e ."]
    extras = [c for run in runs for c in pip_commands(run) if "torch" not in c]
    assert extras == ['pip install -e ".[$EXTRAS]"']  # optional extras only, on top


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_each_image_serves_from_its_own_files_and_checks_health(name):
    steps = instructions(name)
    froms = [args for word, args in steps if word == "FROM"]
    args = dict(a.split("=", 1) for word, a in steps if word == "ARG" and "=" in a)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0])
    assert len(froms) == 1 and base.startswith(IMAGES[name]), base
    copied = [a.split()[:-1] for word, a in steps if word == "COPY"]
    assert all((ROOT / path).exists() for paths in copied for path in paths)
    assert {"pyproject.toml", "legato", "deploy"} <= {p for paths in copied for p in paths}
    entry = json.loads(next(a for word, a in steps if word == "ENTRYPOINT"))
    assert entry[:2] == ["legato", "serve"] and entry[entry.index("--port") + 1] == "8000"
    check = next(a for word, a in steps if word == "HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in check and "--start-period" in check
    assert ("EXPOSE", "8000") in steps


def test_the_images_leave_out_what_they_do_not_need():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
    assert not {"legato", "deploy", "pyproject.toml", "README.md"} & set(ignored)
