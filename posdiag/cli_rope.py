"""The `posdiag rope` command (registered on the app defined in posdiag.cli).

Placeholder: the command is added by the rope work. Keep heavy imports inside the command.
"""
