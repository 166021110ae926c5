from muser_cli.commands import main

main()
