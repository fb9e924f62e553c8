"""The documentation holds together: README.md is a short front door that still shows the two
set-up commands, every relative link of README.md, BENCHMARKS.md and docs/*.md reaches a file (and
a heading, for a #anchor), every command and option of the CLI is documented in docs/usage.md, and
docs/ops.md is exactly what the op contracts generate. No onnxruntime session, no kernel build."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import click
import pytest

from fusecli.commands.main import cli
from fusecli.ops import docs as ops_docs

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 260

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a link in a code block is no link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, inline markup and punctuation dropped (except
    '-' and '_'), spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text
    text = text.strip().lower()
    text = "".join(ch for ch in text
                   if ch in "-_ " or unicodedata.category(ch)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    prose = _prose(path.read_text())
    prose = re.sub(r"`[^`\n]*`", "", prose)              # inline code is no link either
    return _LINK.findall(prose) + _IMAGE.findall(prose)


def dead_links(pages: list[Path] = PAGES, root: Path = REPO) -> list[str]:
    dead = []
    for page in pages:
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):     # http:, mailto: ...: not ours
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(root)}: ({target})"
            if not dest.exists():
                dead.append(f"{where}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return dead


def test_no_dead_relative_link_in_the_documentation():
    assert len(PAGES) > 5, PAGES
    dead = dead_links()
    assert not dead, "dead links (fix the link or the heading):\n" + "\n".join(dead)


def test_the_link_check_finds_a_dead_file_and_a_dead_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## The `verify` command: feeds\n")
    page.write_text("# P\n\n[ok](other.md#the-verify-command-feeds) [self](#p)\n"
                    "[gone](missing.md) [bad anchor](other.md#nope)\n"
                    "```sh\n[in code](missing2.md)\n```\n")
    dead = dead_links([page], tmp_path)
    assert len(dead) == 2, dead
    assert "missing.md" in dead[0] and "#nope" in dead[1]


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, cmd in sorted(group.commands.items()):
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def test_every_command_and_option_is_documented_in_usage_md():
    usage = (REPO / "docs" / "usage.md").read_text()
    missing = []
    for path, cmd in _commands(cli):
        words = " ".join(path)
        if f"fusecli {words}" not in usage:
            missing.append(f"command `fusecli {words}`")
        for p in cmd.params:
            if isinstance(p, click.Option):
                longs = [o for o in p.opts if o.startswith("--")] or p.opts
                if not any(o in usage for o in longs) and "--help" not in longs:
                    missing.append(f"option {longs[0]} of `fusecli {words}`")
    assert not missing, ("not documented in docs/usage.md: " + ", ".join(missing))


def test_ops_md_is_generated_from_the_contracts():
    page = REPO / "docs" / "ops.md"
    assert page.read_text() == ops_docs.ops_markdown(), (
        f"docs/ops.md differs from the op contracts: run {ops_docs.REGENERATE}")


def test_ops_md_states_every_op_from_its_contract():
    from fusecli.ops.contracts import load_contracts

    text = ops_docs.ops_markdown()
    c = load_contracts()
    for op in c.ops.values():
        assert f"## `{c.domain}.{op.name}`" in text
        for port in op.inputs + op.outputs:
            assert f"`{port.name}`" in text
        for ln in op.launchers:
            assert ln.name in text
        assert op.replaces, f"{op.folder}/contract.yaml: no `replaces:` (docs/ops.md's table)"


def test_readme_is_a_short_front_door_with_the_two_set_up_commands():
    text = README.read_text()
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"
    assert "make demo" in text and "make test" in text
    assert "](docs/index.md)" in text       # the way to the rest


@pytest.mark.parametrize("page", ["usage.md", "api.md", "ops.md", "rules.md", "architecture.md",
                                  "corpus.md", "gpu.md", "testing.md", "install.md",
                                  "guarantees.md"])
def test_every_page_is_in_the_table_of_contents(page):
    assert (REPO / "docs" / page).exists()
    assert f"]({page})" in (REPO / "docs" / "index.md").read_text()
