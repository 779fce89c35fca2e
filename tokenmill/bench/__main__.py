"""`python -m tokenmill.bench ...`: the bench command on its own, without tokenmill/cli.py."""

import typer

from tokenmill.bench.cli import bench

if __name__ == "__main__":
    typer.run(bench)
