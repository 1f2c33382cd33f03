from megatron_rocm.console import cli

raise SystemExit(cli())
