"""User-facing errors: one line that names the field or file and the fix; the CLI exits 2."""


class UserError(Exception):
    """Bad input from the user (config value, file, argument). The CLI prints it on one line."""
