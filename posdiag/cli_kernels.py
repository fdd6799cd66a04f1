"""The `posdiag kernels` command (registered on the app defined in posdiag.cli).

Placeholder: the command is added by the kernels work. Keep heavy imports inside the command.
"""
