from megatron_rocm.main import cli

raise SystemExit(cli())
