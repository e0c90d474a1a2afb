"""``python -m smddp_lite.launch``: see launcher.py."""

from .launcher import main

raise SystemExit(main())
