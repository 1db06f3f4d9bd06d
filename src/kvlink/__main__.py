"""`python -m kvlink ...`: the `kvlink` command."""

from kvlink.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
