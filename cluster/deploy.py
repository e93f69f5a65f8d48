"""`python -m cluster.deploy`: the deploy CLI (cluster/control/cli.py; the work is in cluster/control/)."""

from cluster.control.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
