from draftline.cli import main

raise SystemExit(main())
