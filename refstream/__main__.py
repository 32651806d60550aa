import sys

from refstream.cli import main

sys.exit(main())
