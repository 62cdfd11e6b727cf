"""README's commands work as written: every `mtcli ...` line in its code blocks and its commands table (and in
docs/usage.md, where README's tasks are described in full) names a real command, options that command takes, and
shipped configs that exist; the links point at files that exist."""

import functools
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.config_loader import shipped_config_names

README = Path(__file__).parents[1] / "README.md"
USAGE = README.parent / "docs" / "usage.md"
TEXT = README.read_text(encoding="utf-8")


def readme_commands(text: str = TEXT) -> list[str]:
    """`mtcli ...` command lines: from ```bash blocks (comments dropped) and from backticks in tables."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = re.sub(r"\\\n\s*", " ", block)  # a command continued on the next line is one command
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            for part in re.split(r"\|| then ", line):
                part = part.strip()
                if part.startswith("torchrun"):
                    part = part[part.index("-m mtcli") + 3 :]
                if part.startswith("mtcli "):
                    lines.append(part)
    for cell in re.findall(r"`(mtcli [^`]+)`", text):
        lines.append(cell)
    return lines


@functools.cache  # each command's help once: the lines repeat commands
def help_of(command: str) -> str:
    result = CliRunner().invoke(app, [*command.split(), "--help"], terminal_width=200)
    assert result.exit_code == 0, f"`mtcli {command}` is not a command: {result.output}"
    return result.output


COMMANDS = readme_commands()
USAGE_COMMANDS = readme_commands(USAGE.read_text(encoding="utf-8"))


def test_readme_lists_commands():
    assert len(COMMANDS) > 20 and len(USAGE_COMMANDS) > 20


def test_the_map_names_every_module():
    """README's "Where things are" is whole: a newcomer finds every module of the package there."""
    layout = TEXT[TEXT.index("## Where things are") :]
    modules = sorted(
        p.name for p in (README.parent / "mtcli").glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert [m for m in modules if m not in layout] == []


SPEED = re.compile(r"\d[\d,.]*\s*(?:sentences/s|tokens/s|tok/s|ms\b|min\b)|MFU|\d+(?:\.\d+)?x\b")
CPU = re.compile(r"AMD EPYC|Intel Xeon|Zen [45]|H100|H200|GPU")


@pytest.mark.parametrize("path", [README, USAGE], ids=["README", "usage"])
def test_every_speed_figure_names_its_machine(path):
    """Timings differ by machine: a paragraph (or a table with the paragraph before it) that gives one says where."""
    text = path.read_text(encoding="utf-8")
    blocks = [b for b in re.sub(r"```.*?```", "", text, flags=re.S).split("\n\n") if b.strip()]
    for previous, block in zip(["", *blocks], blocks):
        context = previous + block if block.lstrip().startswith("|") else block
        if SPEED.search(block):
            assert CPU.search(context), f"a figure without its machine: {block.strip()[:200]}"


@pytest.mark.parametrize("line", COMMANDS + USAGE_COMMANDS)
def test_each_readme_command_and_its_options_exist(line):
    words = shlex.split(line.replace("\\|", "|").replace("...", ""))[1:]
    command = words[0] if words[0] != "data" else f"data {words[1]}"
    if words[0] == "--version":
        return
    text = help_of(command)
    for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
        assert option in text, f"`{line}`: `mtcli {command}` has no {option}"
    for config in re.findall(r"--config (\S+\.yaml)", line):
        assert config in shipped_config_names() or config.startswith("runs/"), f"`{line}`: no shipped {config}"


@pytest.mark.parametrize("path", [README, *sorted((README.parent / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_links_point_at_files_and_anchors(path):
    text = path.read_text(encoding="utf-8")
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", text):
        if target.startswith("http"):
            continue
        linked = path.parent / target if target else path
        assert linked.exists(), target
        if anchor and linked.suffix == ".md":
            assert anchor in headings(linked), f"{path.name}: no heading #{anchor} in {linked.name}"


def headings(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation dropped, spaces as hyphens."""
    titles = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}
