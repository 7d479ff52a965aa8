"""The read-only web page of runs: `tether ui` (server), what it shows (catalog), how (pages, svg)."""
