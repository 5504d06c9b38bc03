"""Per-step time of every method against N x sess.run: `multistep bench`, as a script.

    python benchmarks/overhead.py [--quick] [--problems blobs] [--steps 1 100] ...
"""

import sys

from multistep.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
