from dualtrack.cli.commands import main

main()
