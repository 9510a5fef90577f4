import sys

from libnn.cli import main

sys.exit(main())
