"""``python -m driftcli`` runs the ``drift`` command."""

from driftcli.cli import main

main()
