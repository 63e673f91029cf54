from kubesgl.cli import main

raise SystemExit(main())
