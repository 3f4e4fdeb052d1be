"""``python -m parabench``: the ``parabench`` command."""

import sys

from parabench.cli import main

sys.exit(main())
