"""Layer 12: the HTML report: its page, figures and HTML parts.
"""
