"""Whether every stream's token_sha, by (level, rep), is the same in every bench_concurrent `--json` output in a
folder (the servers of several modes, or of two trees, serving the same requests).

python3 scripts/same_tokens.py DIR [--what modes]   # DIR/*_<level>.out; prints one line, exit 1 if any differ
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def token_shas(folder: Path) -> dict[tuple[str, int], dict[str, list[str]]]:
    """By (level, rep), each output's streams' token_sha, from the last (JSON) line of each `*_<level>.out`."""
    shas: dict[tuple[str, int], dict[str, list[str]]] = {}
    for path in sorted(folder.glob("*_*.out")):
        lines = path.read_text().strip().splitlines()
        if not lines or not lines[-1].startswith("{"):
            continue
        level = path.stem.rsplit("_", 1)[1]
        for run in json.loads(lines[-1])["runs"]:
            shas.setdefault((level, run["rep"]), {})[path.stem] = [s["token_sha"] for s in run["streams"]]
    return shas


def main(argv: list[str] | None = None) -> int:
    """Print how many (level, rep) cells were compared and whether all were equal; 1 if any differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--what", default="modes", help="what the outputs differ in, for the printed line")
    args = parser.parse_args(argv)
    shas = token_shas(args.folder)
    same = all(len({tuple(v) for v in by_output.values()}) == 1 for by_output in shas.values())
    print(f"token_sha across {args.what}: {len(shas)} (level, rep) cells, {'all equal' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
