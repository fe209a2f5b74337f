"""The docs' shape (issue 41, item 6): docs/DESIGN.md stays an overview of at most 700 lines with a page per topic
under docs/, BENCHMARKS.md the current figures in at most 300 lines with the history in benchmarks/HISTORY.md, and
every relative link in them, README.md included, points at a file that exists and, with a #fragment, at a heading
that file has (GitHub's anchors)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = {"docs/DESIGN.md": 700, "BENCHMARKS.md": 300}


def markdown_files() -> list[str]:
    """README.md, BENCHMARKS.md, benchmarks/HISTORY.md and every page under docs/, relative to the root."""
    docs = sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md", "BENCHMARKS.md", "benchmarks/HISTORY.md"] + docs


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target), the target without spaces (an URL or a path, with an optional #fragment or "title")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    """The targets of a markdown text's inline links, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings: lowercased, punctuation but '-' and '_' dropped, spaces to
    '-', a repeated one suffixed -1, -2, ..."""
    found, seen = set(), {}
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_links_and_anchors_are_found_as_github_finds_them():
    text = ("# Settings (`metrale_graph/envs.py`)\n## Buckets, padding, graphs\n## Buckets, padding, graphs\n"
            "```\n# not a heading\n[a](nowhere.md)\n```\n[x](a.md) `[y](b.md)` [z](c.md#part \"title\") "
            "[w](https://example.com)\n")
    assert anchors(text) == {"settings-metrale_graphenvspy", "buckets-padding-graphs", "buckets-padding-graphs-1"}
    assert links(text) == ["a.md", "c.md#part", "https://example.com"]


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_the_overview_pages_stay_short(name):
    lines = read(name).count("\n")
    assert lines <= MAX_LINES[name], (f"{name} is {lines} lines, past {MAX_LINES[name]}: move a topic to its page "
                                      f"under docs/ (or older runs to benchmarks/HISTORY.md)")


def test_every_relative_link_in_the_docs_points_at_what_exists():
    broken = []
    for name in markdown_files():
        for target in links(read(name)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                continue
            path, _, fragment = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
            if not os.path.exists(os.path.join(ROOT, file)):
                broken.append(f"{name}: {target} (no {file})")
            elif fragment and file.endswith(".md") and fragment not in anchors(read(file)):
                broken.append(f"{name}: {target} (no heading #{fragment} in {file})")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_design_links_every_topic_page():
    """A page under docs/ that DESIGN.md does not link is a topic a newcomer cannot find from the overview."""
    design = {os.path.normpath(os.path.join("docs", t.partition("#")[0])) for t in links(read("docs/DESIGN.md"))}
    pages = {n for n in markdown_files() if n.startswith("docs/") and n != "docs/DESIGN.md"}
    assert not pages - design, f"pages docs/DESIGN.md does not link: {sorted(pages - design)}"


def map_section() -> str:
    design = read("docs/DESIGN.md")
    return design[design.index("## Map"):design.index("## Where each topic lives")]


def map_paths() -> list[str]:
    """The files and folders the first column of DESIGN.md's map names: a cell's bare names (`cache_snapshot.py`)
    are in the folder of the cell's first path (`metrale_graph/cache_sizes.py`)."""
    paths = []
    for row in map_section().splitlines():
        if not row.startswith("| `"):
            continue
        folder = ""
        for name in CODE_SPAN.findall(row.split("|")[1]):
            name = name.strip("`")
            if "/" in name:
                folder = name if name.endswith("/") else os.path.dirname(name)
                paths.append(name)
            elif name.endswith(".py"):
                paths.append(os.path.join(folder, name))
    return paths


def test_design_map_names_what_exists():
    missing = [p for p in map_paths() if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"docs/DESIGN.md's map names paths that do not exist: {missing}"


def test_design_map_lists_every_module():
    """Every module and subpackage of the package (metrale_graph/, ops/, capture/, tools/ and the subpackages of
    metrale_graph/) is named in DESIGN.md's map, by path or, in its folder's row, by file name (`app.py`) or
    module name (`prefill`)."""
    section = map_section()
    named = {s.strip("`") for s in CODE_SPAN.findall(section)}
    unlisted = []
    for folder in ("metrale_graph", "ops", "capture", "tools", "metrale_graph/server", "metrale_graph/speculative",
                   "metrale_graph/onnx"):
        for entry in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = f"{folder}/{entry}"
            if entry.endswith(".py") and entry != "__init__.py":
                if not named & {path, entry, entry[:-3]}:
                    unlisted.append(path)
            elif os.path.isfile(os.path.join(ROOT, path, "__init__.py")) and f"{path}/" not in named:
                unlisted.append(f"{path}/")
    assert not unlisted, f"modules docs/DESIGN.md's map does not name (add each to its row): {unlisted}"


def test_testing_page_names_every_test_file():
    """docs/testing.md says what each test file checks: a test file it does not name is one a newcomer cannot
    place."""
    page = read("docs/testing.md")
    files = sorted(n for n in os.listdir(os.path.join(ROOT, "tests")) if n.startswith("test_") and n.endswith(".py"))
    unnamed = [n for n in files if f"`{n}`" not in page]
    assert not unnamed, f"test files docs/testing.md's table does not name (add a row or join one): {unnamed}"
