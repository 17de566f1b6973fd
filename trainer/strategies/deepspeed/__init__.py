"""DeepSpeed ZeRO-2/3: the strategy (`engine`), its JSON configs (`config`, `templates/`)
and what offload needs of a node (`nodes`)."""
