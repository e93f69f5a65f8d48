from cluster.control.cli import main

raise SystemExit(main())
