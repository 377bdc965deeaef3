from saeflow.cli import main

raise SystemExit(main())
