"""Regenerate the README's tables of settings: every ``PAGEKV_*`` variable (:mod:`pagekv.env`)
and every ``pagekv serve`` setting (:mod:`pagekv.store.cli.settings`). Each table sits between a
``<!-- generated: NAME -->`` line and the next ``<!-- end generated -->`` line.

    python scripts/update_readme.py           # rewrite README.md
    python scripts/update_readme.py --check   # exit 1 when README.md is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def tables() -> dict[str, str]:
    from pagekv import env
    from pagekv.store.cli.serve import serve_settings
    from pagekv.store.cli.settings import markdown

    return {"env": env.markdown(), "serve-settings": markdown(serve_settings())}


def render(text: str) -> str:
    """``text`` with every generated table replaced by its current content."""
    for name, table in tables().items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end generated -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no '<!-- generated: {name} -->' block")
        text = pattern.sub(lambda m, t=table: m.group(1) + t + m.group(2), text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="only say whether it is up to date")
    args = ap.parse_args()
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("README.md's generated tables are out of date: python scripts/update_readme.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
