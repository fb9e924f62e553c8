"""Is every fact of an old README in exactly one page of the documentation now?

    .venv/bin/python scripts/check_doc_coverage.py [OLD_COMMIT] [-v]

Splits the README.md of OLD_COMMIT (default: the commit before the documentation was split,
7b9d875) into fragments: each sentence of the prose, each table row, each line of a code block
(fragments under 25 characters are skipped). Each is looked up, after the same normalisation
(links reduced to their text, heading marks, emphasis and whitespace dropped), in every page of
today's documentation (README.md, docs/*.md, BENCHMARKS.md, fusecli/ops/README.md), and counted
as found in exactly one page, in none (reworded, moved into a generated page, or dropped), or
in several (duplicated). -v lists the fragments in none and in several. Not a test: rewording a
sentence is allowed, so a fragment in no page needs a reader's look, which -v gives."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_LEN = 25


def normalise(text: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)   # links, images: their text
    text = re.sub(r"^#+\s*", "", text, flags=re.M)
    text = text.replace("**", "").replace("<br>", " ")
    return " ".join(text.split())


def fragments(text: str) -> list[str]:
    out, para, fenced = [], [], False

    def flush():
        if para:
            prose = normalise(" ".join(para))
            out.extend(s for s in re.split(r"(?<=[.;:])\s+(?=[A-Z`(\"])", prose))
            para.clear()

    for line in text.splitlines():
        if line.strip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith("|"):
            flush()
            out.append(normalise(line))
        elif not line.strip() or line.startswith("#"):
            flush()
            if line.startswith("#"):
                out.append(normalise(line))
        else:
            para.append(line)
    flush()
    return [f for f in out if len(f) >= MIN_LEN and not re.fullmatch(r"[|\-: ]+", f)]


def pages() -> dict[str, str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "BENCHMARKS.md",
             ROOT / "fusecli" / "ops" / "README.md"]
    return {str(p.relative_to(ROOT)): normalise(p.read_text()) for p in paths if p.exists()}


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    old = args[0] if args else "7b9d875"
    text = subprocess.run(["git", "-C", ROOT, "show", f"{old}:README.md"], capture_output=True,
                          text=True, check=True).stdout
    frags = fragments(text)
    docs = pages()
    none, several, one = [], [], 0
    for f in frags:
        where = [name for name, body in docs.items() if f in body]
        if not where:
            none.append(f)
        elif len(where) > 1:
            several.append((f, where))
        else:
            one += 1
    n = len(frags)
    print(f"{old}:README.md: {n} fragments; in exactly one page {one} ({100 * one / n:.1f}%), "
          f"in none {len(none)}, in several {len(several)}")
    if verbose:
        for f in none:
            print("NONE   ", f[:160])
        for f, where in several:
            print("SEVERAL", ", ".join(where), "|", f[:120])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
