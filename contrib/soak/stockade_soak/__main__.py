"""python3 -m stockade_soak: see the package's docstring."""
import sys

from stockade_soak import main

sys.exit(main())
