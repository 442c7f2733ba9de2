"""Registry hooks of this plugin."""
