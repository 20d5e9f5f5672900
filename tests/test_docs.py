"""The README and docs/*.md point at things that exist: every relative link resolves to a file (and an anchor into a
.md file to one of its headings, by GitHub's slug rules), and every repository path they name is there. A moved
section or a renamed file fails here, not on a reader. (README.md's length is capped by `make size`.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path: under one of the project's top-level folders and ending in a file extension (l0_min/algo.py,
# `configs/cpu_long.yaml`; not SGLang's srt/... or a sandbox's data/users.csv), or a top-level file in backticks.
PATH = re.compile(r"(?<![\w./-])(?:l0_min|tests|bench|configs|docs)/[\w./-]*\.(?:py|yaml|md|sh|txt|ini|json)\b")
TOP_FILE = re.compile(r"`((?:train|rollout|evaluate)\.py|requirements(?:-gpu)?\.txt|pytest\.ini|Makefile)`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to hyphens.

    >>> slug("The sampler is the behaviour policy (overlap, TIS)"), slug("Benchmarks (`bench/*.py`)")
    ('the-sampler-is-the-behaviour-policy-overlap-tis', 'benchmarks-benchpy')
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    """The anchors of a markdown file's headings (not of lines in code blocks); a repeated one gets -1, -2, ..."""
    found, count = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", md.read_text()), re.M):
        s = slug(heading)
        count[s] = count.get(s, 0) + 1
        found.add(f"{s}-{count[s] - 1}" if count[s] > 1 else s)
    return found


def problems(md: Path, root: Path = ROOT) -> list[str]:
    """Each broken link and missing path of one markdown file, as 'file: what'."""
    text, out = md.read_text(), []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):  # https://, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            out.append(f"{md.name}: link to {target}: no {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{md.name}: link to {target}: no heading #{anchor} in {dest.name}")
    text = re.sub(r"\]\([^)\s]+\)", "]", text)  # link targets are checked above, relative to the file
    names = set(PATH.findall(text)) | set(TOP_FILE.findall(text))
    out += [f"{md.name}: names {name}, which does not exist" for name in sorted(names) if not (root / name).exists()]
    return out


def test_links_and_paths_resolve():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(docs) >= 4, docs  # README, results, internals, gpu
    bad = [p for md in docs for p in problems(md)]
    assert not bad, "\n".join(bad)


def test_a_broken_link_anchor_or_path_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A b\n\n## Two (x)\n\n## Two (x)\n")
    md = tmp_path / "README.md"
    md.write_text("[ok](docs/a.md#two-x-1) [ok](#c) [web](https://x.org/y)\n\n# C\n\n```\n[not a link](nowhere.md)\n```\n"
                  "[gone](docs/b.md) [bad anchor](docs/a.md#two-x-2) `l0_min/gone.py` `srt/elsewhere.py` `Makefile`\n")
    assert problems(md, tmp_path) == [
        "README.md: link to docs/b.md: no docs/b.md",
        "README.md: link to docs/a.md#two-x-2: no heading #two-x-2 in a.md",
        "README.md: names Makefile, which does not exist",
        "README.md: names l0_min/gone.py, which does not exist",
    ]
