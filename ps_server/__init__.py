"""The psflow ps_server process."""
