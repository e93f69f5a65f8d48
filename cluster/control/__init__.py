"""The control side of a deployment: the deploy CLI and its subcommands (`cli`, `manage`), deploy / drain
/ stop (`deploy`), the PoolController actor (`pools`), placement groups and node packing (`placer`),
`pools: auto` via the planner (`planning`), and connecting to Ray (`runtime`)."""
