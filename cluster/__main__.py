from cluster.deploy import main

raise SystemExit(main())
