"""The model adapter: loading, placement, the family table, sniffing and finer-dtype runs."""
