from dpocache.cli.entry import main

raise SystemExit(main())
