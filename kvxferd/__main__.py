import sys

from kvxferd.cli import main

sys.exit(main())
