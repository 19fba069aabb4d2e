"""``python -m lrjax``: the ``lrjax`` command line."""

import sys

from lrjax.cli import main

sys.exit(main())
