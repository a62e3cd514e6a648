"""``python -m pie``: the ``pie`` command, for an environment whose scripts folder is not on PATH."""

from pie.entry import main

main()
