"""Print README command N (1: install and generate, 2: the test suite) exactly as written.

The commands are the ```bash blocks of README.md's "Set up on a fresh machine" section, so CI
(.ci/run) cannot drift from what users are told to run. Usage: python3 .ci/readme_commands.py N
"""
import os
import re
import sys

SECTION = "## Set up on a fresh machine"
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def commands(path: str = README) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.find(SECTION + "\n")
    if start < 0:
        raise SystemExit(f"{path}: no '{SECTION}' section")
    body = text[start + len(SECTION):]
    end = re.search(r"^## ", body, flags=re.MULTILINE)
    body = body[:end.start()] if end else body
    blocks = [b.strip() for b in re.findall(r"^```bash\n(.*?)^```", body, flags=re.MULTILINE | re.DOTALL)]
    if len(blocks) != 2 or any(not b or "\n" in b for b in blocks):
        raise SystemExit(f"{path}: '{SECTION}' must hold exactly two one-line ```bash blocks, found {blocks!r}")
    return blocks


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("1", "2"):
        raise SystemExit("usage: readme_commands.py 1|2")
    print(commands()[int(sys.argv[1]) - 1])
