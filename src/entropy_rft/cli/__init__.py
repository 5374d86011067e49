"""Layer 13: the erft command line: each command parses its flags and calls the library; the flags several
commands share are declared once (flags).
"""
