"""Around the bridge: graphviz pictures, the demo, timing, the command line."""
