from megatron_rocm.main import main

raise SystemExit(main())
