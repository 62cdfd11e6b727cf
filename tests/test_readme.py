"""README's commands work as written: every `mtcli ...` line in its code blocks and its commands table names a real
command, options that command takes, and shipped configs that exist; the links point at files that exist."""

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.config_loader import shipped_config_names

README = Path(__file__).parents[1] / "README.md"
TEXT = README.read_text(encoding="utf-8")


def readme_commands() -> list[str]:
    """`mtcli ...` command lines: from ```bash blocks (comments dropped) and from backticks in tables."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", TEXT, re.S):
        block = re.sub(r"\\\n\s*", " ", block)  # a command continued on the next line is one command
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            for part in re.split(r"\|| then ", line):
                part = part.strip()
                if part.startswith("torchrun"):
                    part = part[part.index("-m mtcli") + 3 :]
                if part.startswith("mtcli "):
                    lines.append(part)
    for cell in re.findall(r"`(mtcli [^`]+)`", TEXT):
        lines.append(cell)
    return lines


def help_of(command: str) -> str:
    result = CliRunner().invoke(app, [*command.split(), "--help"], terminal_width=200)
    assert result.exit_code == 0, f"`mtcli {command}` is not a command: {result.output}"
    return result.output


COMMANDS = readme_commands()


def test_readme_lists_commands():
    assert len(COMMANDS) > 20


def test_the_map_names_every_module():
    """README's "Where things are" is whole: a newcomer finds every module of the package there."""
    layout = TEXT[TEXT.index("## Where things are") :]
    modules = sorted(
        p.name for p in (README.parent / "mtcli").glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert [m for m in modules if m not in layout] == []


SPEED = re.compile(r"\d[\d,.]*\s*(?:sentences/s|tokens/s|tok/s|ms\b|min\b)|MFU|\d+(?:\.\d+)?x\b")
CPU = re.compile(r"AMD EPYC|Intel Xeon|Zen [45]|H100|H200|GPU")


def test_every_speed_figure_names_its_machine():
    """Timings differ by machine: a paragraph (or a table with the paragraph before it) that gives one says where."""
    blocks = [b for b in re.sub(r"```.*?```", "", TEXT, flags=re.S).split("\n\n") if b.strip()]
    for previous, block in zip(["", *blocks], blocks):
        context = previous + block if block.lstrip().startswith("|") else block
        if SPEED.search(block):
            assert CPU.search(context), f"a figure without its machine: {block.strip()[:200]}"


@pytest.mark.parametrize("line", COMMANDS)
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


def test_readme_links_point_at_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXT):
        if not target.startswith("http"):
            assert (README.parent / target).exists(), target
