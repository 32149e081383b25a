"""The batch job as a script: `python scripts/generate.py --model DIR --input IN --output OUT [...]`,
the same options as `dsjax generate`."""

import sys

from dsjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
