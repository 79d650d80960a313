"""The `specq` command's first step: `specq status JOB` answered with the database driver
alone when it can be (db/glance.py), every other command by cli.py.

cli.py imports the client side whole (SQLAlchemy, pydantic-settings, the ORM models) before
it parses a word; a status polled from a script or a shell loop paid that each time. Only
the plain form goes this way; with any flag (--watch, --interval, -v) or an argument that is
not a job id, cli.py parses and answers as always.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "status" and args[1].isascii() and args[1].isdigit():
        from specq.db.glance import status_text

        text = status_text(int(args[1]))
        if text is not None:
            try:
                print(text, flush=True)
            except BrokenPipeError:  # `specq status 1 | head -1`: as cli.py ends it
                from specq.api.cli import _reader_gone

                return _reader_gone()
            return 0
    from specq.api.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
