from benchmarks.kernel_report.cli import main

raise SystemExit(main())
