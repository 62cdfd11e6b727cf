"""`python -m mtcli` (also what `torchrun -m mtcli train ...` runs)."""

from mtcli.cli import main

if __name__ == "__main__":
    main()
