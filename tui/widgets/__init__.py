"""The dashboard's panels: each takes plain view-model data (tui.model) and posts messages up."""
