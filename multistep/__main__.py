import sys

from multistep.cli import main

sys.exit(main())
