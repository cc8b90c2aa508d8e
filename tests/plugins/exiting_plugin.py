"""A plugin module that exits at import (a script named as a plugin: its top-level argparse or
sys.exit runs on import)."""

import sys

sys.exit(3)
