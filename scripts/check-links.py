#!/usr/bin/env python3
"""Every relative link in the project's Markdown files points at a file that exists, and every
`#anchor` at a heading of that file (GitHub's anchor rules: lower case, punctuation dropped,
spaces as hyphens)."""
import re
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
files = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True,
                       check=True).stdout.split()
link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set:
    found = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            found.add(text.replace(" ", "-"))
    return found


broken = []
for name in files:
    path = root / name
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    for target in link.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{name}: {target} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{name}: {target} (no such heading)")
if broken:
    print("broken links:\n  " + "\n  ".join(broken), file=sys.stderr)
    sys.exit(1)
print(f"links: {len(files)} Markdown files, every relative link resolves")
