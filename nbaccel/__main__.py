"""``python -m nbaccel``: the same command line as the ``nbaccel`` console script."""

from nbaccel.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
