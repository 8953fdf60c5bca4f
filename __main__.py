from dtnode.daemon.cli import main

raise SystemExit(main())
