from dtnode.daemon.cli.main import main

raise SystemExit(main())
