import sys

from cel_utils.cli import main

sys.exit(main())
