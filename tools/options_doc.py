"""Write docs/options.md from nbrpc's one declaration of the cluster's options.

python tools/options_doc.py          # rewrite docs/options.md
python tools/options_doc.py --check  # exit 1 if it is stale (tests/unit/test_options.py)
"""

from __future__ import annotations

import pathlib
import sys

from nbrpc import _option_text

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "options.md"

HEAD = """# Options of `%rpc_init`, `nbrpc.init` and `nbrpc.Cluster`

Generated from `nbrpc/_options.py` (`python tools/options_doc.py`), where each option is
declared once: its type, its `%rpc_init` flag, its default and what it does. Every option
is a keyword argument of `nbrpc.init(n, **options)` and `nbrpc.Cluster(n, **options)`;
those with a flag are also arguments of `%rpc_init` (`%rpc_init?` lists them). Bad values
are refused with a `ConfigError` before anything starts.

`%rpc_init` also takes `--quiet` (no progress display and no summary).

"""


def render() -> str:
    return HEAD + _option_text.options_doc() + "\n"


def main(argv: list[str]) -> int:
    if "--check" in argv:
        return 0 if DOC.read_text() == render() else 1
    DOC.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
