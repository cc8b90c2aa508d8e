import sys

from mesh.cli import main

sys.exit(main())
