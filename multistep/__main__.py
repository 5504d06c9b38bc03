import sys

from multistep.tools.cli import main

sys.exit(main())
