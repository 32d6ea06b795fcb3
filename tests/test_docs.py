"""The README's commands are what CI runs, and every path it names exists."""

from __future__ import annotations

import re

from helpers import REPO

README = (REPO / "README.md").read_text()
DOCS = sorted((REPO / "docs").glob("*.md"))


def test_readme_starts_with_the_two_setup_commands():
    first_block = README.split("```bash\n")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make demo", "make test"]


def test_ci_runs_the_readme_test_command():
    """CI runs `make test`, and each command it runs is one the README names."""
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert "make test" in lines
    assert all(f"`{line}`" in README for line in lines if line.startswith("make "))


def test_make_targets_in_readme_exist():
    makefile = (REPO / "Makefile").read_text()
    named = README + "".join(p.read_text() for p in DOCS)
    for target in set(re.findall(r"`make ([a-z-]+)`", named)) | {"demo", "test"}:
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), target


def test_the_readme_is_a_landing_page_that_links_every_doc():
    """What a first visit needs fits in about 200 lines; the reference is in docs/, each page linked from it."""
    assert len(README.splitlines()) <= 200
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", README))
    assert linked == {f"docs/{p.name}" for p in DOCS}
    for page in DOCS:  # links between pages resolve
        for target in re.findall(r"\]\(([\w-]+\.md)\)", page.read_text()):
            assert (page.parent / target).is_file(), (page.name, target)


def test_every_path_named_in_the_docs_exists():
    docs = README + "".join(p.read_text() for p in [*DOCS, *(REPO / "recipes").rglob("*.yaml")])
    paths = set(re.findall(r"\b((?:recipes|accelerate_configs|finetune|tests|bench|docs|\.ci)/[\w./-]*\w)", docs))
    assert paths, "no paths found"
    missing = [p for p in sorted(paths) if not (REPO / p).exists()]
    assert not missing


def test_the_recipe_table_lists_every_key_of_every_section():
    """docs/configs.md's table of recipe keys holds every field of every section (and of a mixture's sources)."""
    import dataclasses
    import typing

    from finetune.config import RecipeConfig, SourceConfig

    rows = {}
    for line in (REPO / "docs" / "configs.md").read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) == 2:
            rows[re.match(r"\| `(\w+)`", line)[1]] = cells[1]
    hints = typing.get_type_hints(RecipeConfig)
    for field in dataclasses.fields(RecipeConfig):  # each section's type: a dataclass, or one of a union's
        section = next(
            t for t in (hints[field.name], *typing.get_args(hints[field.name])) if dataclasses.is_dataclass(t)
        )
        keys = {key.name for key in dataclasses.fields(section)}
        if field.name == "data":
            keys |= {key.name for key in dataclasses.fields(SourceConfig)}
        assert field.name in rows, f"no row for the {field.name} section"
        documented = set(re.findall(r"`(\w+)`", rows[field.name]))
        assert keys <= documented, (field.name, sorted(keys - documented))
