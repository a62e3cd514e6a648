"""`python -m pie_engine_xla.serve ARGS`: ``pie serve --engine xla --process-group ARGS``, the same command on
every host of the group (see ``pie serve --help``: "One model over several processes")."""

import sys

from pie.cli import app

if __name__ == "__main__":
    app(["serve", "--engine", "xla", "--process-group", *sys.argv[1:]], prog_name="python -m pie_engine_xla.serve")
