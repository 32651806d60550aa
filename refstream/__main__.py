import sys

from refstream.tools.cli import main

sys.exit(main())
