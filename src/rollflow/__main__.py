from rollflow.cli import main

raise SystemExit(main())
